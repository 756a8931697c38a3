"""Tests of evaluation/metrics/ against hand-computed values.

Run: python -m pytest tests/evaluation/test_evaluation_metrics.py -q
"""

import math

import numpy as np
import pytest
import torch

import evaluation
from evaluation import metrics as M

# ----------------------------------------------------------------------------- registry


def test_registry_names_and_directions():
    assert M.list_metrics() == [
        "all_values_match",
        "bleu",
        "greedy_match",
        "kl_divergence",
        "perplexity",
        "ppl_increase_pct",
        "qa_f1",
        "retrieval_accuracy",
        "rouge_l",
    ]
    higher = {name: M.get_metric(name).higher_is_better for name in M.list_metrics()}
    assert higher == {
        "all_values_match": True,
        "bleu": True,
        "greedy_match": True,
        "kl_divergence": False,
        "perplexity": False,
        "ppl_increase_pct": False,
        "qa_f1": True,
        "retrieval_accuracy": True,
        "rouge_l": True,
    }
    # a registered Metric is callable and is the same function as the module attribute
    assert M.get_metric("qa_f1").fn is M.qa_f1
    assert M.get_metric("greedy_match")([1, 2], [1, 3]) == 0.5


def test_unknown_metric_lists_names_and_suggests():
    with pytest.raises(M.UnknownMetricError) as info:
        M.get_metric("rougel")
    msg = str(info.value)
    assert "did you mean 'rouge_l'" in msg
    for name in M.list_metrics():
        assert name in msg
    # catchable as ValueError and KeyError
    with pytest.raises(ValueError):
        M.get_metric("zzzzzz")
    with pytest.raises(KeyError):
        M.get_metric("zzzzzz")
    # no suggestion when nothing is close
    try:
        M.get_metric("zzzzzz")
    except M.UnknownMetricError as err:
        assert "did you mean" not in str(err)


def test_register_twice_rejected():
    with pytest.raises(ValueError, match="already registered"):
        M.register_metric("bleu", higher_is_better=True, unit="x")(lambda a, b: 0.0)


def test_package_reexports():
    assert evaluation.qa_f1 is M.qa_f1
    assert evaluation.METRICS is M.METRICS


# ----------------------------------------------------------------------------- text


def test_normalize_answer_longbench():
    assert M.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert M.normalize_answer("An apple, a pear and THE plum.") == "apple pear and plum"
    assert M.normalize_answer("theatre") == "theatre"  # articles only as whole words


@pytest.mark.parametrize(
    "prediction, answer, expected",
    [
        ("The REGISTER_CONTENT in line 12 is <31337>.", "31337", True),
        ("31337", "31337", True),
        ("line 12: 0031337", "31337", True),  # compared as integers
        ("31337? no, it is 4", "31337", False),  # LAST integer counts (LongEval)
        ("I do not know.", "31337", False),
        ("3133", "31337", False),
        ("The first topic was Quantum Physics.", "quantum physics", True),
        ("We talked about the weather.", "quantum physics", False),
        ("The passcode is: 'tiger-lily'", "Tiger lily", False),  # punctuation removed, not spaced
        ("The passcode is tigerlily", "tiger-lily", True),
    ],
)
def test_retrieval_accuracy(prediction, answer, expected):
    assert M.retrieval_accuracy(prediction, answer) is expected


def test_retrieval_accuracy_bad_input():
    with pytest.raises(ValueError, match="empty after normalisation"):
        M.retrieval_accuracy("anything", "the")
    with pytest.raises(ValueError, match="must be a str"):
        M.retrieval_accuracy(123, "123")


def test_qa_f1_hand_computed():
    # pred tokens [cat, sat, on, mat], truth [cat, on, mat]: P=3/4, R=1 -> F1=6/7
    assert M.qa_f1("The cat sat on the mat.", ["a cat on a mat"]) == pytest.approx(6 / 7)
    # max over answers
    assert M.qa_f1("Paris", ["London", "paris", "Rome"]) == 1.0
    # pred [paris, france], truth [paris]: P=1/2, R=1 -> 2/3
    assert M.qa_f1("Paris, France", ["Paris"]) == pytest.approx(2 / 3)
    # repeated tokens are a multiset: pred [a a] after normalisation? use non-articles
    # pred [go, go, go], truth [go]: common 1, P=1/3, R=1 -> 0.5
    assert M.qa_f1("go go go", ["go"]) == pytest.approx(0.5)
    assert M.qa_f1("nothing shared", ["Paris"]) == 0.0
    assert M.qa_f1("", ["Paris"]) == 0.0
    # a single str is one answer, not a list of characters
    assert M.qa_f1("Paris", "Paris") == 1.0


def test_qa_f1_first_line():
    pred = "\nParis\nIt is the capital of France."
    assert M.qa_f1(pred, ["Paris"], first_line=True) == 1.0
    # without it: [paris, it, is, capital, of, france] vs [paris]: P=1/6 -> 2/7
    assert M.qa_f1(pred, ["Paris"]) == pytest.approx(2 / 7)


def test_qa_f1_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        M.qa_f1("x", [])


def test_rouge_l_hand_computed():
    # LCS(the cat sat on the mat | the cat on the mat) = 5: P=5/6, R=1 -> 10/11
    assert M.rouge_l("the cat sat on the mat", "the cat on the mat") == pytest.approx(10 / 11)
    assert M.rouge_l("Hello, World!", "hello world") == 1.0  # rouge-score tokeniser
    assert M.rouge_l("abc def", "xyz") == 0.0
    assert M.rouge_l("", "") == 1.0  # identical
    assert M.rouge_l("", "something") == 0.0


def test_bleu_hand_computed():
    # p1=5/6 (clipped 'the'), p2=3/5, p3=2/4, p4=1/3, BP=1 -> (1/12)^(1/4)
    expected = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert M.bleu("the cat sat on the mat", "the cat sat on a mat") == pytest.approx(expected, rel=1e-9)
    assert M.bleu("the cat sat on the mat", "the cat sat on the mat") == 100.0
    assert M.bleu("", "") == 100.0
    assert M.bleu("completely different", "the cat sat on a mat") == 0.0


# ----------------------------------------------------------------------------- logits


def test_perplexity_uniform_is_vocab_size():
    logits = torch.zeros(5, 7)
    targets = torch.tensor([0, 1, 2, 3, 6])
    assert M.perplexity(logits, targets) == pytest.approx(7.0, rel=1e-12)


def test_perplexity_hand_computed():
    # row 0: p = [1/4, 3/4], target 1 -> 0.75; row 1: p = [1/2, 1/2], target 0 -> 0.5
    logits = torch.log(torch.tensor([[1.0, 3.0], [1.0, 1.0]]))
    targets = torch.tensor([1, 0])
    expected = math.exp(-(math.log(0.75) + math.log(0.5)) / 2)  # 1/sqrt(0.375) = 1.63299
    assert M.perplexity(logits, targets) == pytest.approx(expected, rel=1e-6)
    # bf16 and numpy inputs are accepted
    assert M.perplexity(logits.to(torch.bfloat16), targets) == pytest.approx(expected, rel=1e-2)
    assert M.perplexity(logits.numpy(), np.array([1, 0])) == pytest.approx(expected, rel=1e-6)


def test_perplexity_bad_input():
    with pytest.raises(ValueError, match=r"\[n, vocab\]"):
        M.perplexity(torch.zeros(3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="to match logits"):
        M.perplexity(torch.zeros(3, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        M.perplexity(torch.zeros(2, 4), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="integer"):
        M.perplexity(torch.zeros(2, 4), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="NaN"):
        M.perplexity(torch.full((2, 4), float("nan")), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="empty"):
        M.perplexity(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))


def test_ppl_increase_pct():
    assert M.ppl_increase_pct(10.2, 10.0) == pytest.approx(2.0)
    assert M.ppl_increase_pct(9.954, 10.0) == pytest.approx(-0.46)
    with pytest.raises(ValueError, match="positive"):
        M.ppl_increase_pct(10.0, 0.0)
    with pytest.raises(ValueError):
        M.ppl_increase_pct(float("nan"), 10.0)


def test_kl_divergence_hand_computed():
    # row 0: KL([.5,.5] || [.25,.75]) = .5 ln 2 + .5 ln(2/3) = .5 ln(4/3); row 1 identical -> 0
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.2, 0.8]]))
    test = torch.log(torch.tensor([[0.25, 0.75], [0.2, 0.8]]))
    expected = 0.5 * math.log(4 / 3) / 2
    assert M.kl_divergence(ref, test) == pytest.approx(expected, rel=1e-6)
    # not symmetric: KL([.25,.75] || [.5,.5]) = .25 ln .5 + .75 ln 1.5
    expected_rev = (0.25 * math.log(0.5) + 0.75 * math.log(1.5)) / 2
    assert M.kl_divergence(test, ref) == pytest.approx(expected_rev, rel=1e-6)
    # identical logits -> exactly 0, never negative
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert M.kl_divergence(x, x.clone()) == 0.0
    # shift invariance of softmax
    assert M.kl_divergence(x, x + 3.0) == pytest.approx(0.0, abs=1e-12)


def test_kl_divergence_masked_vocab():
    # -inf in the reference (p_ref = 0) contributes 0; in the test side it makes KL infinite
    ref = torch.tensor([[0.0, 0.0, float("-inf")]])
    test = torch.tensor([[0.0, 0.0, 0.0]])
    # p_ref = [.5,.5,0], p = [1/3]*3 -> KL = ln(1.5)
    assert M.kl_divergence(ref, test) == pytest.approx(math.log(1.5), rel=1e-9)
    assert M.kl_divergence(test, ref) == math.inf


def test_kl_divergence_shape_mismatch():
    with pytest.raises(ValueError, match="differ in shape"):
        M.kl_divergence(torch.zeros(2, 3), torch.zeros(2, 4))


def test_greedy_match():
    assert M.greedy_match([1, 2, 3], [1, 2, 4, 5]) == 0.5  # shorter: missing = mismatch
    assert M.greedy_match([1, 2, 3, 4, 9], [1, 2, 3, 4]) == 1.0  # extra tokens ignored
    assert M.greedy_match(torch.tensor([7, 8, 9]), np.array([7, 0, 9])) == pytest.approx(2 / 3)
    assert M.greedy_match([], []) == 1.0
    assert M.greedy_match([1], []) == 0.0
    assert M.greedy_match([], [1, 2]) == 0.0
    with pytest.raises(ValueError):
        M.greedy_match("abc", [1, 2, 3])
    with pytest.raises(ValueError, match="1-D"):
        M.greedy_match(torch.zeros(2, 2, dtype=torch.long), [1])


# ----------------------------------------------------------------------------- aggregation


def test_aggregate_hand_computed():
    agg = M.aggregate([1, 2, 3, 4, None])
    assert agg["n"] == 4
    assert agg["median"] == 2.5
    assert agg["p25"] == pytest.approx(1.75)
    assert agg["p75"] == pytest.approx(3.25)
    assert agg["mean"] == 2.5
    # sample std = sqrt(5/3); stderr = sqrt(5/3)/2
    assert agg["stderr"] == pytest.approx(math.sqrt(5 / 3) / 2)


def test_aggregate_bools_and_edge_cases():
    mean, stderr = M.mean_stderr([True, False, True, True])
    assert mean == 0.75
    assert stderr == pytest.approx(0.25)  # std(ddof=1)=0.5, /sqrt(4)
    assert M.mean_stderr([3.0]) == (3.0, None)
    assert M.aggregate([None, None]) == {
        "n": 0, "median": None, "p25": None, "p75": None, "mean": None, "stderr": None
    }
    assert M.median([5, 1, 3]) == 3.0
    assert M.quantile([0, 10], 0.25) == 2.5
    with pytest.raises(ValueError, match="NaN"):
        M.aggregate([1.0, float("nan")])
    with pytest.raises(ValueError, match="no values"):
        M.median([None])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        M.quantile([1, 2], 1.5)
    with pytest.raises(ValueError, match="non-numeric"):
        M.median(["a"])


def test_scored_answer_is_what_retrieval_accuracy_reads():
    from evaluation import scored_answer

    # numeric answers: the last run of digits (LongEval's rule), None without one
    assert scored_answer("the passcode is 82716", "82716") == 82716
    assert scored_answer("the text above is 82716.", "82716") == scored_answer("It is <82716>", "82716")
    assert scored_answer("82716 or 12", "82716") == 12
    assert scored_answer("no number here", "82716") is None
    # phrases: whether the normalised gold answer occurs
    assert scored_answer("The topic was: The Weather!", "the weather") is True
    assert scored_answer("sports", "the weather") is False
    with pytest.raises(ValueError):
        scored_answer(None, "1")


def test_registered_metrics_are_the_functions_of_their_names():
    # a decorator left above the wrong function once registered scored_answer (which returns
    # the number read, truthy for ANY number) as "retrieval_accuracy": every answer "correct"
    import evaluation.metrics as m
    from evaluation import get_metric, list_metrics

    for name in list_metrics():
        fn = getattr(m, name, None)
        if fn is not None:
            assert get_metric(name).fn is fn, name
    acc = get_metric("retrieval_accuracy")
    assert acc("the passcode is 12345", "82716") is False
    assert acc("the passcode is 82716", "82716") is True


# ----------------------------------------------------------------------------- answer suite scorer


@pytest.mark.parametrize("pred,answers,want", [
    ("The special magic number for amber-falcon is 4920113.", ["4920113"], True),
    ("is: 4920113", ["4920113"], True),
    ("49201130", ["4920113"], False),                    # a longer run of digits is another number
    ("4920112", ["4920113"], False),
    ("are 1234567, 7654321 and 1111111.", ["7654321", "1234567", "1111111"], True),
    ("are 1234567 and 7654321.", ["7654321", "1234567", "1111111"], False),   # one value missing
    ("", ["1234567"], False),
    ("The answer is Paris.", ["paris"], True),           # a non-numeric answer: substring, any case
])
def test_all_values_match_known_answers(pred, answers, want):
    assert M.all_values_match(pred, answers) is want
    assert M.get_metric("all_values_match").fn is M.all_values_match


def test_all_values_match_bad_input():
    for answers in ([], "1234567", [""]):
        with pytest.raises(ValueError):
            M.all_values_match("x", answers)
    with pytest.raises(ValueError):
        M.all_values_match(None, ["1"])


def test_stated_values_is_what_agreement_compares():
    assert M.stated_values("5, 12 and 5") == M.stated_values("12, then 5") == (5, 12)
    assert M.stated_values("no number") == ()
    assert M.stated_values("1234567 and 7") != M.stated_values("1234567")


@pytest.mark.parametrize("listed", [
    ":\n\n1. 9868160\n2. 6971908\n3. 5148657", ":\n\n- 9868160\n- 6971908\n- 5148657",
    "1) 9868160\n2) 6971908\n3) 5148657", "  (1) 9868160\n  (2) 6971908\n  (3) 5148657",
    "- 1. 9868160\n- 2. 6971908\n- 3. 5148657", "9868160, 6971908 and 5148657.",
    "1.\n9868160\n2.\n6971908\n3.\n5148657"])
def test_stated_values_ignore_the_numbers_of_list_items(listed):
    """A list's item numbers are formatting: the same values listed with numbers, bullets or
    in a sentence are the same stated values."""
    assert M.stated_values(listed) == (5148657, 6971908, 9868160)


def test_stated_values_keep_numbers_that_are_values():
    # a number inside a line, or opening a line but not followed by "." / ")" and a blank, is stated
    assert M.stated_values("The values are 1. 2 and 3") == (1, 2, 3)
    assert M.stated_values("12 apples\n3.5 pears") == (3, 5, 12)
    assert M.stated_values("1.5\n2)x") == (1, 2, 5)
    assert M.stated_values("1234. 9868160") == (1234, 9868160)   # 4 digits: not a list number
