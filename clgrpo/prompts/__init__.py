"""Every text a model is shown that does not come from data: one module per role.

Rollouts (what the policy is asked): ``rollout`` (the layout every domain's rollout prompt shares),
``math_rollout`` and ``web_rollout`` (each domain's system message, tool descriptions and example lessons),
``agent`` (the tool instructions of agent rollouts). The learner: ``summarize``, ``extract`` (the group
advantage as operations), ``contrast`` (one lesson from a correct and a wrong attempt, and its rewrite),
``consolidate``, ``repair`` (the re-ask after an unusable reply). Grading: ``judge``. Shared by several roles:
``quoting`` (data tags and the notice every system message carries), ``attempts`` (the problem, library and
attempts as the learner sees them) and ``lessons`` (what a lesson is, example replies).

This package is core: it imports only ``schemas`` and the standard library, so every layer above may use it.
Wording changes here change prompt hashes (a rollout stored with another prompt is sampled again).
"""

from __future__ import annotations

Message = dict[str, str]  # one chat message: role and content
