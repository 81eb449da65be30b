"""jaxfednas.evidence with a toy search: what a researcher's own search plugs in (the guide's
"Searched vs random for your own search"), the draws, the numbers, the page and resume."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxfednas.evidence import Control, Labels, Names, random_architectures, searched_vs_random, write_page
from jaxfednas.rng import random_arch_key
from jaxfednas.seeds import kendall_tau, mean_std, repeat_seed


def toy_control(trained: list, searched: int = 90, match=None) -> Control:
    """Architectures are widths 1..100; a width trains to width / 100 (+ 0.01 for every other
    training seed), and inherits 1 - width / 100 from its supernet (a reversed ranking)."""
    def train(name, width, training_seed):
        trained.append((name, width, training_seed))
        return width / 100 + (0.0 if training_seed is None else 0.01 * (training_seed % 2 * 2 - 1))

    return Control(searched=searched, sample=lambda key: int(jax.random.randint(key, (), 1, 101)), train=train,
                   size=lambda width: 10 * width, match=match,
                   inherited=lambda widths: [1 - w / 100 for w in widths])


def test_searched_vs_random_trains_each_architecture_once_and_reports_the_comparison(tmp_path):
    trained = []
    ev = searched_vs_random(toy_control(trained), tmp_path, seed=3, random=4, train_seeds=3)
    randoms = [int(jax.random.randint(random_arch_key(3, i), (), 1, 101)) for i in range(4)]
    assert list(ev.randoms) == randoms  # draw i from random_arch_key(seed, i): every method meets the same ones
    assert trained == [("searched", 90, None), ("searched_seed_1", 90, repeat_seed(3, 1)),
                       ("searched_seed_2", 90, repeat_seed(3, 2))] + \
        [(f"random_{i}", w, None) for i, w in enumerate(randoms)]
    scores = [w / 100 for w in randoms]
    n = ev.numbers()
    assert n["searched cell: test acc"] == 0.9 and n["random cells: mean"] == pytest.approx(mean_std(scores)[0])
    assert n["searched − random mean"] == pytest.approx(0.9 - mean_std(scores)[0])
    assert n["random cells beaten (fraction)"] == sum(0.9 > s for s in scores) / 4
    assert n["searched cell: std over 3 training seeds"] == pytest.approx(mean_std(ev.repeats)[1])
    assert mean_std(ev.repeats)[1] > 0
    assert n["architecture signal-to-noise"] == pytest.approx(mean_std(scores)[1] / mean_std(ev.repeats)[1])
    # the reversed inherited ranking: τ = -1 (when the widths differ)
    tau = kendall_tau([1 - w / 100 for w in [90, *randoms]], [0.9, *scores])
    assert n["supernet ranking: Kendall τ"] == pytest.approx(tau) and tau < 0
    assert ev.points() == {"searched": (900, 0.9), "random": [(10 * w, w / 100) for w in randoms]}


def test_matched_draws_stay_within_ten_percent_of_the_searched_cost(tmp_path):
    control = toy_control([], searched=50, match=lambda width: width)
    widths = random_architectures(control, 0, 6)
    assert all(45 <= w <= 55 for w in widths) and len(set(widths)) > 1


def test_write_page_and_names(tmp_path):
    trained = []
    ev = searched_vs_random(toy_control(trained), tmp_path, seed=0, random=2, train_seeds=2,
                            names=Names(searched="train", repeat="train_seed_{j}", random="random-{i}"))
    assert [t[0] for t in trained] == ["train", "train_seed_1", "random-0", "random-1"]
    labels = Labels(searched="searched width: score", random_mean="random widths: mean")
    page = write_page(tmp_path, ev, title="Toy search", labels=labels, head=[("search rounds", "3")],
                      extra={"space": "widths"})
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["numbers"] == page["numbers"] == ev.numbers(labels) and record["space"] == "widths"
    assert record["head"] == {"search rounds": "3"} and record["training_seeds"] == list(ev.repeats)
    assert [a["score"] for a in record["architectures"]] == [ev.score, *ev.random_scores]
    text = (tmp_path / "results.md").read_text()
    assert text.startswith("# Toy search\n") and "| search rounds | 3 |" in text
    assert f"| searched width: score | {ev.score:.4f} |" in text and "| random widths: mean |" in text
    assert (tmp_path / "plots" / "searched_vs_random.png").stat().st_size > 0


def test_without_random_architectures_only_the_searched_score(tmp_path):
    ev = searched_vs_random(toy_control([]), tmp_path, seed=0, random=0, train_seeds=1)
    assert ev.numbers() == {"searched cell: test acc": 0.9} and ev.ranking is None
    with pytest.raises(ValueError, match="train_seeds"):
        searched_vs_random(toy_control([]), tmp_path, seed=0, random=1, train_seeds=0)


def test_a_batched_search_scores_the_same_draws_together(tmp_path):
    """Control.evaluate: one call scores the searched width over its training seeds and the
    random widths (the library's draws, as the one-at-a-time path meets them)."""
    calls = []

    def evaluate(randoms, train_seeds):
        calls.append((list(randoms), train_seeds))
        widths = np.asarray([90, *randoms])
        return {"repeats": [0.9, 0.91, 0.89][:train_seeds], "random": (widths[1:] / 100).tolist(),
                "inherited": (1 - widths / 100).tolist(), "per_client": "kept"}

    one = searched_vs_random(toy_control([]), tmp_path, seed=3, random=4, train_seeds=3)
    control = Control(searched=90, sample=lambda key: int(jax.random.randint(key, (), 1, 101)), evaluate=evaluate,
                      size=lambda width: 10 * width)
    ev = searched_vs_random(control, tmp_path, seed=3, random=4, train_seeds=3)
    assert calls == [(list(one.randoms), 3)] and ev.randoms == one.randoms
    assert ev.random_scores == pytest.approx(one.random_scores) and ev.repeats == (0.9, 0.91, 0.89)
    assert ev.points() == one.points() and ev.ranking == one.ranking and ev.details["per_client"] == "kept"
    assert ev.snr["seed_std"] == pytest.approx(0.01)


def test_a_batched_search_may_draw_its_own_architectures(tmp_path):
    """Without ``sample`` the search draws (here one width per client, from
    fold_in(random_arch_key(seed, i), k)) and gets the draws' indices; its scores are client means."""
    def draw(i, k):
        return int(jax.random.randint(jax.random.fold_in(random_arch_key(7, i), k), (), 1, 101))

    def evaluate(randoms, train_seeds):
        drawn = [[draw(i, k) for k in range(3)] for i in randoms]
        return {"randoms": drawn, "random": [float(np.mean(d)) / 100 for d in drawn], "repeats": [0.5, 0.4],
                "sizes": [10.0] + [float(np.mean(d)) for d in drawn]}

    ev = searched_vs_random(Control(searched=[50, 50, 50], evaluate=evaluate), tmp_path, seed=7, random=2,
                            train_seeds=2)
    assert list(ev.randoms) == [[draw(i, k) for k in range(3)] for i in range(2)] and ev.inherited is None
    labels = Labels(searched="searched (mean over clients)", random_std=None, beaten=None, difference="searched − random")
    n = ev.numbers(labels)
    assert list(n) == ["searched (mean over clients)", "random cells: mean", "searched − random",
                       "searched cell: std over 2 training seeds", "architecture signal-to-noise"]
    assert n["searched − random"] == pytest.approx(0.5 - np.mean(ev.random_scores))
    assert ev.points()["random"] == [(s, a) for s, a in zip(ev.sizes[1:], ev.random_scores)]
    with pytest.raises(ValueError, match="evaluate returned 2 repeats"):
        searched_vs_random(Control(searched=0, evaluate=evaluate), tmp_path, seed=7, random=2, train_seeds=3)
    with pytest.raises(ValueError, match="exactly one of train"):
        Control(searched=0, sample=lambda key: 1)
    with pytest.raises(ValueError, match="needs sample"):
        Control(searched=0, train=lambda *a: 0.0)
