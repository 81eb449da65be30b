"""The searched-vs-random experiment: does a search find a better architecture than a draw?

Every paper example asks the same question of its search, and so can a new search: train
the architecture the search found and ``N`` architectures drawn uniformly from the same
space, each from scratch with the same recipe on the same clients, and compare. Two
diagnostics say what the comparison can mean: the **architecture signal-to-noise ratio**
(the spread over the random architectures over the spread of the searched one over
training seeds: below ~1 the task cannot tell architectures apart) and the **supernet's
ranking** (Kendall's τ / Spearman's ρ between each architecture's accuracy with the weights
it inherits from the searched supernet and its accuracy trained alone).

A search plugs in with a :class:`Control` (its half: the searched architecture, a sampler
of its space, how to train and score one architecture) and :func:`searched_vs_random` runs
the rest, resumable stage by stage::

    runner = StageRunner(out, resume=True, describe=str)
    control = Control(
        searched=genotype,
        sample=lambda key: random_genotype(key, prims, nodes),
        train=stage_trainer(runner, lambda arch, seed: config_for(arch, seed)),
        size=lambda arch: network_params(arch, **shape),
        inherited=(out / "search", make_inherited_accuracy),
        key=lambda arch: arch.to_json())
    ev = searched_vs_random(control, out, seed=0, random=5, train_seeds=3)
    write_page(out, ev, title="My search: searched vs random")

Random architecture ``i`` of a job of seed ``s`` is drawn with
:func:`jaxfednas.rng.random_arch_key` ``(s, i)`` (with ``match``: the first draw from that
key within ±10 % of the searched architecture's cost, :func:`~jaxfednas.search_spaces.sampling.matched`),
so every method run with the same seed meets the same random architectures. Training seed
``j`` of the searched architecture is :func:`jaxfednas.seeds.repeat_seed` ``(s, j)`` on the
same partition. Over several seeds, :func:`jaxfednas.seeds.over_seeds` tables
:meth:`Evidence.numbers` of each.

A search whose architectures are scored together (every client's at once, one batch per
call, kept in its own cache) gives ``evaluate`` instead of ``train``: ``evaluate(randoms,
train_seeds)`` scores the searched architecture over ``train_seeds`` training seeds and the
random ones in one go. ``randoms`` are the draws above where the control has a ``sample``;
without one the search draws its own (SPIDER: per client, from ``fold_in(random_arch_key(s,
i), k)``, size-matched per client) and ``randoms`` is ``range(random)``, the draws' indices::

    def evaluate(randoms, train_seeds):   # e.g. one batched fine-tuning of every mask
        r = my_batch(len(randoms), train_seeds)
        return {"repeats": r.searched, "random": r.draws, "sizes": r.sizes, "inherited": r.inherited}

    ev = searched_vs_random(Control(searched=masks, evaluate=evaluate), out, seed=0, random=5,
                            train_seeds=3)

``ev.details`` keeps what ``evaluate`` returned (e.g. per-client scores the search reports
beside the comparison).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxfednas.checkpoint import atomic_write_text
from jaxfednas.rng import random_arch_key
from jaxfednas.seeds import mean_std, repeat_seed, signal_to_noise, supernet_ranking, versus_random


@dataclasses.dataclass(frozen=True)
class Control:
    """A search's half of the experiment.

    Attributes:
      searched: the architecture the search found.
      sample: ``sample(key) -> architecture``, a uniform draw from the searched space; None
        where ``evaluate`` draws its own.
      train: ``train(name, architecture, training_seed) -> score``: train the architecture
        from scratch with the evaluation recipe (as stage ``name`` of the job, resumable) and
        return its score; ``training_seed`` None is the job's own seed, else another training
        seed on the same partition. :func:`stage_trainer` builds one from a config per
        architecture.
      evaluate: instead of ``train``, for a search that scores its architectures together:
        ``evaluate(randoms, train_seeds) -> {"repeats": [score per training seed, the job's
        own first], "random": [score per random architecture]}``, optionally with ``"randoms"``
        (the architectures it drew, where the control has no ``sample``: it gets the draws'
        indices), ``"sizes"`` and ``"inherited"`` (searched first, as :class:`Evidence`'s).
      size: ``size(architecture) -> parameters`` (the plot's x axis), or None.
      match: ``match(architecture) -> cost``: draw each random architecture within ±10 % of
        the searched one's cost (e.g. parameters or multiply-adds); None draws uniformly.
      inherited: for the supernet's ranking, ``(search run directory, make_accuracy)`` as
        :func:`jaxfednas.stages.inherited_accuracies` takes them (kept in ``inherited.json``),
        or any ``inherited(architectures) -> accuracies``; None: no ranking.
      key: ``key(architecture) -> str``, the architecture's name in ``inherited.json`` and
        ``results.json``.
    """

    searched: Any
    sample: Callable[[Any], Any] | None = None
    train: Callable[[str, Any, int | None], float] | None = None
    size: Callable[[Any], float] | None = None
    match: Callable[[Any], float] | None = None
    inherited: tuple[str | os.PathLike, Callable] | Callable[[list], Sequence[float]] | None = None
    key: Callable[[Any], str] = str
    evaluate: Callable[[Sequence, int], dict] | None = None

    def __post_init__(self):
        if (self.train is None) == (self.evaluate is None):
            raise ValueError("a Control needs exactly one of train (one architecture at a time) and evaluate (together)")
        if self.train is not None and self.sample is None:
            raise ValueError("a Control that trains one architecture at a time needs sample")


@dataclasses.dataclass(frozen=True)
class Names:
    """The stage names of one job (``{i}``: the random architecture, ``{j}``: the training
    seed), kept per example so that its recorded run directories resume."""

    searched: str = "searched"
    repeat: str = "searched_seed_{j}"
    random: str = "random_{i}"


@dataclasses.dataclass(frozen=True)
class Labels:
    """How :meth:`Evidence.numbers` names its numbers (``{n}``: the training seeds); each
    example keeps the names of its recorded tables. A number named None is left out."""

    searched: str = "searched cell: test acc"
    random_mean: str = "random cells: mean"
    random_std: str | None = "random cells: std"
    beaten: str | None = "random cells beaten (fraction)"
    seed_std: str = "searched cell: std over {n} training seeds"
    difference: str = "searched − random mean"
    snr: str = "architecture signal-to-noise"
    kendall: str = "supernet ranking: Kendall τ"
    spearman: str = "supernet ranking: Spearman ρ"


@dataclasses.dataclass(frozen=True)
class Evidence:
    """One job's result: the searched architecture's score over its training seeds
    (``repeats[0]`` is the job's own seed), the random architectures' scores, their sizes
    and inherited accuracies (searched first; None where the control has none); ``details``:
    what :attr:`Control.evaluate` returned (None for a control that trains one at a time)."""

    seed: int
    searched: Any
    randoms: tuple
    repeats: tuple[float, ...]
    random_scores: tuple[float, ...]
    sizes: tuple[float, ...] | None
    inherited: tuple[float, ...] | None
    key: Callable[[Any], str] = dataclasses.field(default=str, compare=False, repr=False)
    details: dict | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def score(self) -> float:
        return self.repeats[0]

    @property
    def versus(self) -> dict:
        """:func:`jaxfednas.seeds.versus_random` of the searched score and the random ones."""
        return versus_random(self.score, self.random_scores)

    @property
    def snr(self) -> dict:
        """:func:`jaxfednas.seeds.signal_to_noise`: random spread / training-seed spread."""
        return signal_to_noise(self.random_scores, self.repeats)

    @property
    def ranking(self) -> dict | None:
        """:func:`jaxfednas.seeds.supernet_ranking` over the searched and random architectures."""
        if self.inherited is None:
            return None
        return supernet_ranking(list(self.inherited), [self.score, *self.random_scores])

    def numbers(self, labels: Labels = Labels()) -> dict[str, float]:
        """The comparison's numbers by name, as :func:`jaxfednas.seeds.over_seeds` tables them:
        :meth:`versus_numbers`, then :meth:`diagnostic_numbers`."""
        if not self.randoms:
            return {labels.searched: self.versus["searched"]}
        return self.versus_numbers(labels) | self.diagnostic_numbers(labels)

    def versus_numbers(self, labels: Labels = Labels()) -> dict[str, float]:
        """The searched score against the random ones: their mean and std, the difference and
        the fraction of random architectures beaten."""
        vs = self.versus
        out = {labels.searched: vs["searched"], labels.random_mean: vs["random_mean"],
               labels.random_std: vs["random_std"], labels.difference: vs["searched_minus_random"],
               labels.beaten: vs["beats"] / len(self.random_scores)}
        return {k: v for k, v in out.items() if k is not None}

    def diagnostic_numbers(self, labels: Labels = Labels()) -> dict[str, float]:
        """The std over training seeds, the architecture signal-to-noise ratio and, with
        inherited accuracies, the supernet's ranking."""
        out = {labels.seed_std.format(n=len(self.repeats)): self.snr["seed_std"], labels.snr: self.snr["ratio"]}
        if self.ranking is not None:
            out |= {labels.kendall: self.ranking["kendall_tau"], labels.spearman: self.ranking["spearman"]}
        return out

    def points(self) -> dict:
        """The searched and random ``(size, score)`` pairs, as
        :func:`jaxfednas.plots.plot_searched_vs_random` takes one seed's (sizes 0 without ``size``)."""
        sizes = self.sizes or (0,) * (1 + len(self.randoms))
        return {"searched": (sizes[0], self.score), "random": [(n, a) for n, a in zip(sizes[1:], self.random_scores)]}

    def to_json(self) -> dict:
        """Every architecture's numbers, searched first (``results.json``'s ``architectures``)."""
        n = 1 + len(self.randoms)
        return {"architectures": [
            {"role": "searched" if i == 0 else f"random {i - 1}",
             "architecture": self.key(a), "score": ([self.score] + list(self.random_scores))[i],
             "size": None if self.sizes is None else self.sizes[i],
             "inherited": None if self.inherited is None else self.inherited[i]}
            for i, a in zip(range(n), [self.searched, *self.randoms])],
            "training_seeds": list(self.repeats)}


def random_architectures(control: Control, seed: int, n: int) -> list:
    """The ``n`` random architectures of a job of ``seed``: draw ``i`` from
    ``random_arch_key(seed, i)``, matched in cost to the searched one if ``control.match``."""
    from jaxfednas.search_spaces.sampling import matched  # noqa: PLC0415  (the spaces import the core)

    if control.match is None:
        return [control.sample(random_arch_key(seed, i)) for i in range(n)]
    target = control.match(control.searched)
    return [matched(random_arch_key(seed, i), control.sample, control.match, target)[0] for i in range(n)]


def searched_vs_random(control: Control, out: str | os.PathLike, *, seed: int, random: int, train_seeds: int,
                       names: Names = Names()) -> Evidence:
    """Train the searched architecture with ``train_seeds`` training seeds and ``random``
    random architectures once each (stages named by ``names``, trained by ``control.train``)
    or score them together (``control.evaluate``), measure the inherited accuracies (kept in
    ``out/inherited.json``); the :class:`Evidence`."""
    if random < 0 or train_seeds < 1:
        raise ValueError(f"random must be >= 0 and train_seeds >= 1, got {random} and {train_seeds}")
    randoms = random_architectures(control, seed, random) if control.sample is not None else list(range(random))
    details = sizes = inherited = None
    if control.evaluate is not None:
        details = control.evaluate(randoms, train_seeds)
        repeats, scores = [float(x) for x in details["repeats"]], [float(x) for x in details["random"]]
        randoms = list(details.get("randoms", randoms))
        if (len(repeats), len(scores), len(randoms)) != (train_seeds, random, random):
            raise ValueError(f"evaluate returned {len(repeats)} repeats and {len(scores)} random scores of "
                             f"{len(randoms)} architectures for train_seeds={train_seeds}, random={random}")
        sizes = None if details.get("sizes") is None else tuple(details["sizes"])
        inherited = None if details.get("inherited") is None else tuple(float(a) for a in details["inherited"])
    else:
        repeats = [float(control.train(names.searched, control.searched, None))]
        for j in range(1, train_seeds):  # the same architecture, other training seeds: the seed noise
            repeats.append(float(control.train(names.repeat.format(j=j), control.searched, repeat_seed(seed, j))))
        scores = [float(control.train(names.random.format(i=i), a, None)) for i, a in enumerate(randoms)]
    archs = [control.searched, *randoms]
    if sizes is None and control.size is not None:
        sizes = tuple(control.size(a) for a in archs)
    if inherited is None and callable(control.inherited) and randoms:
        inherited = tuple(float(a) for a in control.inherited(archs))
    elif inherited is None and control.inherited is not None and randoms:
        from jaxfednas import stages  # noqa: PLC0415  (stages imports the runtime)

        search_dir, make_accuracy = control.inherited
        inherited = tuple(stages.inherited_accuracies(out, search_dir, archs, make_accuracy, key=control.key))
    return Evidence(seed, control.searched, tuple(randoms), tuple(repeats), tuple(scores), sizes, inherited,
                    control.key, details)


def stage_trainer(runner, config_for: Callable[[Any, int | None], Any], *,
                  score: Callable[[dict], float] = lambda s: s["final"]["global_test_acc"]) -> Callable:
    """A :attr:`Control.train` that runs each architecture as a stage of ``runner``
    (:class:`jaxfednas.stages.StageRunner`: resumable, its wall time kept):
    ``config_for(architecture, training_seed)`` is the stage's configuration, ``score`` reads
    the number from its ``summary.json``."""
    return lambda name, arch, training_seed: score(runner.stage(name, config_for(arch, training_seed))[0])


def write_results(out: str | os.PathLike, title: str, body: str, record, *, sort_keys: bool = False) -> None:
    """A page of an example: ``out/results.md`` (``# title`` and the Markdown ``body``) and
    ``out/results.json`` (``record``), written by process 0 only; the body is printed."""
    from jaxfednas.distributed import is_main  # noqa: PLC0415

    print("\n" + body)
    if is_main():
        atomic_write_text(Path(out) / "results.md", f"# {title}\n\n{body}")
        atomic_write_text(Path(out) / "results.json", json.dumps(record, indent=1, sort_keys=sort_keys,
                                                                  default=float) + "\n")


def diagnostics_note(arch: str, trained: str, train_seeds: int) -> str:
    """The sentences that say what a table over seeds' diagnostics mean (``arch``: "cell",
    "child", ...; ``trained``: how each was trained, e.g. "augmented")."""
    return (f"The searched {arch} is {trained} with {train_seeds} training seeds: its std over them is the noise of "
            f"the architecture signal-to-noise ratio (std over the random {arch}s / that std). The supernet ranking "
            f"is Kendall's τ (Spearman's ρ) over the seed's {arch}s between their accuracy with the weights "
            f"inherited from the supernet and their accuracy {trained}. Plot: `plots/searched_vs_random.png`.")


def _fmt(x: float) -> str:
    return "nan" if x != x else f"{x:.4f}"


def evidence_table(ev: Evidence, labels: Labels = Labels(), *, head: Sequence[tuple[str, str]] = (),
                   describe: Callable[[Any], str] | None = None, size_name: str = "parameters") -> str:
    """The comparison as Markdown: the search's own ``head`` rows (label, text) and the
    comparison's numbers, then one row per architecture (``describe`` names it; default
    ``Control.key``) with its size, score and inherited accuracy."""
    lines = ["| quantity | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in head]
    signed = {labels.difference: "{:+.4f}", labels.snr: "{:.2f}", labels.kendall: "{:+.3f}",
              labels.spearman: "{:+.3f}"}
    lines += [f"| {k} | {_fmt(v) if k not in signed or v != v else signed[k].format(v)} |"
              for k, v in ev.numbers(labels).items()]
    lines.append(f"| {labels.searched} over the {len(ev.repeats)} training seeds | "
                 f"{', '.join(_fmt(x) for x in ev.repeats)} ({'{} ± {}'.format(*map(_fmt, mean_std(ev.repeats)))}) |")
    describe = describe or ev.key
    rows = ["", f"| architecture | {size_name} | score | inherited from the supernet |", "|---|---|---|---|"]
    for role, data in zip(["searched"] + [f"random {i}" for i in range(len(ev.randoms))], ev.to_json()["architectures"]):
        arch = ev.searched if role == "searched" else ev.randoms[int(role.split()[1])]
        size = "–" if data["size"] is None else f"{data['size']:,}"
        inh = "–" if data["inherited"] is None else _fmt(data["inherited"])
        rows.append(f"| {role}: {describe(arch)} | {size} | {_fmt(data['score'])} | {inh} |")
    return "\n".join(lines + (rows if ev.randoms else [])) + "\n"


def write_page(out: str | os.PathLike, ev: Evidence, *, title: str, labels: Labels = Labels(),
               head: Sequence[tuple[str, str]] = (), preface: str = "", extra: dict | None = None,
               metric: str = "test accuracy", describe: Callable[[Any], str] | None = None,
               size_name: str = "parameters", plot_title: str = "") -> dict:
    """Write one job's page: ``out/results.md`` (``title``; ``preface``, Markdown of the
    search's own; :func:`evidence_table` with the search's own rows ``head``, label and
    text), ``out/results.json`` (``numbers``, ``points``, ``head`` by label, the
    architectures and training seeds' scores, and ``extra``) and
    ``out/plots/searched_vs_random.png``; print the page; return ``{"numbers", "points"}``
    for :func:`jaxfednas.seeds.over_seeds`."""
    from jaxfednas.distributed import is_main  # noqa: PLC0415
    from jaxfednas.plots import plot_searched_vs_random  # noqa: PLC0415

    numbers, points = ev.numbers(labels), ev.points()
    if ev.randoms and is_main():
        plot_searched_vs_random({ev.seed: points}, Path(out) / "plots" / "searched_vs_random.png", metric=metric,
                                title=plot_title or title)
    write_results(out, title, preface + evidence_table(ev, labels, head=head, describe=describe, size_name=size_name),
                  {"numbers": numbers, "points": points, "head": dict(head), **ev.to_json(), **(extra or {})})
    return {"numbers": numbers, "points": points}
