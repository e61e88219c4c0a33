"""Usefulness and confidence per experience (clgrpo/experience/usefulness.py): which ids a summary cites, and the Beta
posterior over the citing attempts' outcomes."""

from clgrpo.experience.usefulness import cited_ids, confidence, describe_stat, step_stats
from schemas.records import ExperienceStat, GroupAdvantage, Reward, Summary


def test_a_summary_cites_the_ids_it_says_were_used_not_those_ignored():
    text = "The attempt used E1 and E3. It ignored E2. It did not use E4; E10 is not listed."
    assert cited_ids(text, ["E1", "E2", "E3", "E4", "E5"]) == {"E1", "E3"}
    assert cited_ids("It followed E2 and E5.", ["E2"]) == {"E2"}  # only ids of the library shown


def test_confidence_is_the_beta_posterior_mean_with_a_credible_interval():
    mean, low, high = confidence(8, 2)
    assert abs(mean - 9 / 12) < 1e-12 and low < mean < high and 0.4 < low < 0.6 and 0.85 < high < 0.97
    assert confidence(0, 0)[0] == 0.5 and confidence(0, 0)[1] < 0.05


def test_step_stats_add_the_steps_citations_to_the_surviving_ids():
    previous = [
        ExperienceStat(exp_id="E1", cited=2, cited_correct=2, cited_wrong=0, cited_in_variance=1),
        ExperienceStat(exp_id="E9", cited=5, cited_correct=1, cited_wrong=4),
    ]  # deleted since
    summaries = [
        Summary(problem_id="p", sample_idx=0, text="It used E1."),
        Summary(problem_id="p", sample_idx=1, text="It used E1 and E2."),
        Summary(problem_id="q", sample_idx=0, text="It used E2.", error=None),
    ]
    rewards = [
        Reward(problem_id="p", sample_idx=0, reward=1.0),
        Reward(problem_id="p", sample_idx=1, reward=0.0),
        Reward(problem_id="q", sample_idx=0, reward=None, error="could not verify", verified=False),
    ]
    advantages = [
        GroupAdvantage(
            problem_id="p",
            rewards=[1.0, 0.0],
            mean_reward=0.5,
            std_reward=0.5,
            advantages=[1.0, -1.0],
            selected=True,
            reason="variance",
        )
    ]
    stats = {
        s.exp_id: s for s in step_stats(previous, ["E1", "E2", "E3"], ["E1", "E2"], summaries, rewards, advantages)
    }
    assert set(stats) == {"E1", "E2", "E3"}
    assert (stats["E1"].cited, stats["E1"].cited_correct, stats["E1"].cited_wrong, stats["E1"].cited_in_variance) == (
        4,
        3.0,
        1.0,
        3,
    )
    assert (stats["E2"].cited, stats["E2"].cited_wrong) == (1, 1.0)  # the ungraded attempt does not count
    assert stats["E3"].cited == 0 and describe_stat(stats["E3"]) == "never cited yet"
    assert describe_stat(stats["E1"]).startswith("cited 4x (3 correct / 1 wrong, 3 in groups with variance)")
