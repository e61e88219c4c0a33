"""A scripted model for the web domain (served over HTTP by ``FakeOpenAIServer``): a browsing agent on the
generated site (``clgrpo.testing.web_world``) and the learner roles.

The agent, given a town question, either walks the site (open the start page, the town's link, then the mayor's
or river's link, and reads the fact) or answers from memory (a wrong guess). It walks with probability
``p_lesson`` when the web lesson is in its prompt, else ``p_base``; it also uses ``search`` first when a search
lesson is listed. The summarizer says whether the attempt opened pages and cites the lesson it followed; the
extractor proposes the web lesson when a group's attempts differ (by grade, or without grades by whether they
opened pages) and the library lacks it.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
from collections import Counter

from clgrpo.testing.fake_openai import ChatRequest, Reply, role_of

WEB_LESSON = (
    "When a question names a place, open the start page and follow its links hop by hop to the page stating the fact."
)
WEB_KEY = "follow its links hop by hop"
QUESTION_RE = re.compile(r"(?:mayor of|flows through) ([A-Z][a-z]+)")
START_RE = re.compile(r"Start page: (\S+)")
LINE_RE = re.compile(r"^\[([^\]]+)\]\.\s*(.*)$", re.MULTILINE)
GRADE_RE = re.compile(r"^Attempt(?: \d+)? \(graded ([^)]+)\):", re.MULTILINE)


class ScriptedWebWorld:
    models = ("scripted",)

    def __init__(self, seed: int = 0, p_base: float = 0.25, p_lesson: float = 0.95) -> None:
        self.seed, self.p_base, self.p_lesson = seed, p_base, p_lesson
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.opened: list[str] = []

    def __call__(self, request: ChatRequest) -> list[str | Reply]:
        role = role_of(request)
        with self.lock:
            self.counts[role] += 1
        if role == "policy":
            return [self._agent(request, i) for i in range(request.n)]
        handler = {
            "trajectory summarizer": self._summarize,
            "experience extractor": self._extract,
            "answer judge": self._judge,
            "library consolidator": self._consolidate,
        }.get(role)
        return [handler(request) if handler else json.dumps({"operations": []}) for _ in range(request.n)]

    # --- the browsing agent -----------------------------------------------------------------------------------
    def _rng(self, request: ChatRequest, index: int) -> random.Random:
        """Per first turn: the k-th request with the same prompt gets the k-th draw (the G rollouts of a problem
        are separate conversations with the same prompt)."""
        first = next(m["content"] for m in request.messages if m.get("role") == "user")
        with self.lock:
            self.counts[first] += 1
            occurrence = self.counts[first]
        digest = hashlib.sha256(f"{self.seed}|{first}|{index}|{occurrence}".encode()).hexdigest()
        return random.Random(int(digest[:16], 16))

    def _agent(self, request: ChatRequest, index: int) -> str | Reply:
        user = next(m["content"] for m in request.messages if m.get("role") == "user")
        town = QUESTION_RE.search(user)
        start = START_RE.search(user)
        if town is None or start is None:
            return "I cannot tell what to look up. Final answer: unknown"
        asks_river = "river" in user.split("<problem", 1)[-1]
        results = [m["content"] for m in request.messages if m.get("role") == "tool"]
        if not results:
            walk = self.p_lesson if WEB_KEY in user else self.p_base
            rng = self._rng(request, index)
            if rng.random() >= walk:
                guess = rng.randint(1931, 1990) if not asks_river else 123
                return f"I remember this one. Final answer: {guess}"
            return self._open(start.group(1).rstrip(".,)"), "I will start at the start page.")
        page = results[-1]
        fact = re.search(r"It is (\d+) km long" if asks_river else r"was born in (\d{4})", page)
        if fact:
            return f"The page states it. Final answer: {fact.group(1)}"
        wanted = (
            (r"/rivers/" if asks_river else r"/mayors/")
            if f"Title: {town.group(1)}" in page
            else rf"/towns/{town.group(1).lower()}\.html"
        )
        link = re.search(rf"-> (\S*{wanted}\S*)", page)
        if link is None or len(results) >= 4:
            return "I could not find it on the pages. Final answer: unknown"
        return self._open(link.group(1), "Following the link.")

    def _open(self, url: str, text: str) -> Reply:
        with self.lock:
            self.opened.append(url)
        return Reply(content=text, tool_calls=(("open", {"url": url}),))

    # --- learner roles ----------------------------------------------------------------------------------------
    def _judge(self, request: ChatRequest) -> str:
        user = next(m["content"] for m in request.messages if m.get("role") == "user")
        reference = re.search(r"<answer>\n(.*?)\n</answer>", user, re.DOTALL).group(1).strip()
        candidate = re.search(r"<attempt>\n(.*?)\n</attempt>", user, re.DOTALL).group(1).strip()
        same = reference.casefold() in candidate.casefold()
        reason = "it states the reference value" if same else f"{candidate!r} is not {reference!r}"
        return json.dumps({"correct": same, "reason": reason})

    def _summarize(self, request: ChatRequest) -> str:
        user = next(m["content"] for m in request.messages if m.get("role") == "user")
        attempt = user.split("<attempt", 1)[-1]
        opened = attempt.count("open(") + attempt.count('"open"') + attempt.count("Title: ")
        listed = dict(LINE_RE.findall(user.split("<attempt", 1)[0]))
        cite = next((f" It followed {i}." for i, text in listed.items() if WEB_KEY in text and opened), "")
        how = "It opened pages and followed links." if opened else "It answered without opening any page."
        return f"{how}{cite}"

    def _consolidate(self, request: ChatRequest) -> str:
        """The proposed web lesson once, unless the library has it."""
        user = next(m["content"] for m in request.messages if m.get("role") == "user")
        library, _, proposals = user.partition("Proposals:")
        if WEB_LESSON not in proposals or WEB_KEY in library:
            return json.dumps({"operations": []})
        return json.dumps({"operations": [{"op": "add", "text": WEB_LESSON, "sources": []}]})

    def _extract(self, request: ChatRequest) -> str:
        user = next(m["content"] for m in request.messages if m.get("role") == "user")
        library = user.split("Problem", 1)[0]
        grades = set(GRADE_RE.findall(user))
        walked = "opened pages" in user
        guessed = "without opening any page" in user
        mixed = len(grades) > 1 if grades else (walked and guessed)
        if not mixed or WEB_KEY in library:
            return json.dumps({"operations": []})
        return json.dumps(
            {
                "operations": [
                    {"op": "add", "text": WEB_LESSON, "why": "The attempts that walked the site found the fact."}
                ]
            }
        )
