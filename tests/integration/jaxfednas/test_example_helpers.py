"""The library pieces the paper examples share: the ``--only`` flag, a run directory's
readers, a configuration's network size from shapes, the settings every compared method
takes, a cached step, the personalization plots, and the controls' summaries."""
import json

import jax
import numpy as np
import pytest

from jaxfednas.algorithms import perfedrlnas as pf
from jaxfednas.algorithms import spider as sp
from jaxfednas.cost import count_params, model_params
from jaxfednas.data.federated import DataInfo
from jaxfednas.example_args import ExampleParser
from jaxfednas.plots import plot_gain_matrix, plot_memory_vs_budget
from jaxfednas.registry import make_config
from jaxfednas.reports import client_acc_summary, client_table, read_client_test_acc, read_metrics
from jaxfednas.search_spaces.darts.genotypes import cell_text
from jaxfednas.search_spaces.models import init_variables, make_model
from jaxfednas.stages import cached_json, shared_settings

METHODS = ("a", "b", "c")


def _parser(default):
    p = ExampleParser("doc")
    p.add_methods(METHODS, default=default, help="methods")
    return p


def test_add_methods_keeps_the_choices_order_and_rejects_unknown_names(capsys):
    assert _parser(METHODS).parse_args(["--only", " c,a,c "]).only == ("a", "c")
    assert _parser(METHODS).parse_args([]).only == METHODS
    assert _parser(None).parse_args([]).only is None
    for bad in ("a,x", ","):
        with pytest.raises(SystemExit) as e:
            _parser(None).parse_args(["--only", bad])
        assert e.value.code == 2
    assert "unknown method(s) []; choose from a, b, c" in capsys.readouterr().err


def test_readers_give_back_what_a_run_wrote(tmp_path):
    manifest = {"clients": [{"train": [0, 1], "val": [], "test": [2, 3]}, {"train": [4], "val": [5], "test": [6]}]}
    csv_text, _ = client_table({"client_test_acc": np.array([0.5, 1.0])}, manifest)
    (tmp_path / "clients.csv").write_text(csv_text)
    np.testing.assert_array_equal(read_client_test_acc(tmp_path), [0.5, 1.0])
    rows = [{"round": 1, "x": 1.0}, {"round": 2, "x": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"round": 3, "x"')
    assert read_metrics(tmp_path) == rows  # a line cut short is left out


def test_client_acc_summary_by_hand():
    s = client_acc_summary([0.5, np.nan, 1.0])
    assert s["client_test_acc"][::2] == [0.5, 1.0] and np.isnan(s["client_test_acc"][1])
    assert (s["mean"], s["std"], s["min"], s["max"]) == (0.75, 0.25, 0.5, 1.0)


def _info(shape=(8, 8, 1), classes=10):
    return DataInfo("digits", 4, classes, shape, 16.0, (0.0,) * shape[-1], (1.0,) * shape[-1])


def test_model_params_counts_the_built_network_without_allocating_or_its_auxiliary_head():
    cfg = make_config("fedavg", overrides={"data.dataset": "digits"})
    model = make_model(cfg.algo.model, 10, "digits")
    real = init_variables(model, jax.random.PRNGKey(0), (8, 8, 1))["params"]
    assert model_params(cfg, _info()) == count_params(real) > 0
    info = _info((32, 32, 3))
    plain = make_config("fednas_train", overrides={"algo.C": 4, "algo.layers": 3})
    aux = make_config("fednas_train", overrides={"algo.C": 4, "algo.layers": 3, "algo.auxiliary_weight": 0.4})
    assert model_params(aux, info) == model_params(plain, info) > 0
    search = make_config("fednas", overrides={"algo.C": 4, "algo.layers": 3})
    assert model_params(search, info) > model_params(plain, info)  # the supernet: every op on every edge


def test_shared_settings_are_the_main_runs_data_and_run_fields():
    cfg = make_config("spider", overrides={"data.num_clients": 5, "run.rounds": 7, "run.seed": 3})
    s = shared_settings(cfg, algo=("batch_size",))
    assert (s["data.num_clients"], s["run.rounds"], s["run.seed"]) == (5, 7, 3)
    assert s["algo.batch_size"] == cfg.algo.batch_size and "data.split" not in s
    assert make_config("ditto", overrides=s).data.num_clients == 5  # valid overrides of another method


def test_cached_json_is_reused_on_resume_only_for_the_same_key(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"value": len(calls)}

    path = tmp_path / "step.json"
    assert cached_json(path, {"rounds": 2}, False, compute) == {"key": {"rounds": 2}, "value": 1}
    assert cached_json(path, {"rounds": 2}, True, compute)["value"] == 1 and len(calls) == 1
    assert cached_json(path, {"rounds": 3}, True, compute)["value"] == 2  # another run: computed again
    assert cached_json(path, {"rounds": 3}, False, compute)["value"] == 3  # without resume: always
    assert json.loads(path.read_text()) == {"key": {"rounds": 3}, "value": 3}


def test_personalization_plots_write_the_same_png_twice(tmp_path):
    p = np.array([[0.8, 0.1], [0.3, 0.7]])
    for name in ("a", "b"):
        plot_gain_matrix(p, sp.personalization_gain(p), tmp_path / f"{name}.png", title="t")
    clients = {str(k): {"memory_bytes": m, "memory_budget_bytes": 2 ** 21, "fits": m <= 2 ** 21}
               for k, m in enumerate([2 ** 20, 2 ** 22, 2 ** 21])}
    for name in ("c", "d"):
        plot_memory_vs_budget({"run one": clients, "run two": clients}, tmp_path / f"{name}.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    assert (tmp_path / "c.png").read_bytes() == (tmp_path / "d.png").read_bytes()
    assert (tmp_path / "a.png").read_bytes() != (tmp_path / "c.png").read_bytes()


def test_cell_text_writes_two_ops_per_node():
    assert cell_text([("sep_conv_3x3", 0), ("skip_connect", 1), ("max_pool_3x3", 2), ("none", 0)]) == \
        "sep3(0)+skip(1) / max3(2)+none(0)"


def test_spider_control_numbers_by_hand():
    """Searched masks 0.7, 0.5 (client mean 0.6) against draws of client means 0.55 and 0.45
    (mean 0.5): the searched beats 2 of the 4 client x draw pairs (ties lose)."""
    from jaxfednas.evidence import Control, searched_vs_random

    g = {"matrix": [[0.7, 0.1], [0.2, 0.5]],
         "random": {"draws": 2, "acc": [[0.6, 0.4], [0.5, 0.5]], "params": [[10, 20], [30, 40]],
                    "searched_params": [10, 14]}}

    def numbers(g, train_seeds=1):
        control = Control(None, evaluate=lambda randoms, t: sp.client_means(g))
        ev = searched_vs_random(control, ".", seed=0, random=2, train_seeds=train_seeds)
        return sp.control_numbers(ev, sp.searched_versus_random(ev))

    n = numbers(g)
    assert n["searched − random"] == pytest.approx(0.1)
    assert n["client × draw pairs where searched beats random (fraction)"] == 0.5
    assert n["random masks: parameters (mean)"] == 25.0 and n["searched masks: parameters (mean over clients)"] == 12
    assert not any("signal-to-noise" in k for k in n)
    g["random"] |= {"repeats": [[0.72, 0.5]], "inherited": [[0.3, 0.2, 0.1]] * 2}
    n = numbers(g, train_seeds=2)  # client means 0.6, 0.61: seed std 0.01 / 2 ** 0.5; random std 0.1 / 2 ** 0.5
    assert n["architecture signal-to-noise"] == pytest.approx(10.0) and n["supernet ranking: Kendall τ"] == 1.0


def _perfedrlnas_control(learned_supernet, learned_local, rand: dict) -> dict:
    """pf.control_summary of a random_subnets.json ``rand`` (pf.control's evaluate, without the run)."""
    from jaxfednas.evidence import Control, searched_vs_random

    for i, d in enumerate(rand["draws"]):
        d.setdefault("choices", [[i]] * len(learned_local))
    control = Control(None, evaluate=lambda randoms, t: pf.client_means(learned_supernet, learned_local, 12.0, rand))
    ev = searched_vs_random(control, ".", seed=0, random=len(rand["draws"]), train_seeds=1 + len(rand["repeats"]))
    return pf.control_summary(ev)


def test_perfedrlnas_control_summary_by_hand():
    """Learned client accuracies 0.8, 0.4 (supernet weights) against two draws with client
    means 0.5 and 0.7: the learned mean 0.6 beats one draw; client 0 beats its draws' mean
    0.6, client 1 not (0.6)."""
    rand = {"draws": [{"supernet_weights": [0.4, 0.6], "local_epochs": [0.5, 0.5], "params_mean": 10.0},
                      {"supernet_weights": [0.8, 0.6], "local_epochs": [0.7, 0.7], "params_mean": 30.0}],
            "repeats": [[0.7, 0.7]]}
    c = _perfedrlnas_control(np.array([0.8, 0.4]), [0.8, 0.8], rand)
    assert (c["draws"], c["params_mean"], c["draw_params"]) == (2, 20.0, [10.0, 30.0])
    v = c["supernet_weights"]
    assert v["searched"] == pytest.approx(0.6) and v["random_acc"] == pytest.approx([0.5, 0.7])
    assert v["beats"] == 1 and v["clients_beating_random"] == 0.5
    assert c["local_epochs"]["beats"] == 2 and c["local_epochs"]["clients_beating_random"] == 1.0
    assert c["diagnostics"]["train_seeds"] == 2 and c["diagnostics"]["n"] == 3


def test_wins_over_seeds_counts_the_positive_differences_per_name():
    from jaxfednas.seeds import wins_over_seeds

    rows = {0: {"a: x − y": 0.1, "a: x": 0.5}, 1: {"a: x − y": -0.3, "a: x": 0.4}, 2: {"a: x − y": 0.5}}
    text = wins_over_seeds(rows, ": x − y", winner="x", loser="y", title="X vs Y:")
    assert text == "X vs Y:\n\n- a: x beat y in 2 of 3 seeds (x − y +0.1000 on average).\n"
    assert wins_over_seeds(rows, ": nothing", winner="x", loser="y", title="t") == ""


def test_perfedrlnas_control_report_lists_each_run_and_test():
    rand = {"draws": [{"supernet_weights": [0.4, 0.6], "local_epochs": [0.5, 0.5], "params_mean": 10.0}],
            "repeats": [[0.7, 0.7]]}
    row = {"label": "run", "params": 12.0, "random_control": _perfedrlnas_control(np.array([0.8, 0.4]), [0.8, 0.8], rand)}
    lines = pf.control_report([row])
    assert "| run | supernet weights | 0.6000 | 0.5000 ± 0.0000 | +0.1000 | 1 of 1 | 0.50 |" in lines
    assert "| run | + E local epochs | 0.8000 | 0.5000 ± 0.0000 | +0.3000 | 1 of 1 | 1.00 |" in lines
    assert lines[-1] == "Random subnets' mean parameters: run: 10 (learned 12)."
    assert pf.control_report([]) == []


def test_stage_row_reads_the_stages_client_accuracies_into_a_method_row(tmp_path):
    from jaxfednas.stages import method_row, stage_row

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "clients.csv").write_text("client,n_train,n_val,n_test,test_acc\n0,5,0,4,0.500000\n"
                                                "1,5,0,4,1.000000\n")

    class Runner:  # StageRunner's stage: the summary and the wall time
        out = tmp_path

        def stage(self, name, cfg):
            return {"final": {"params": 7.0}}, 12.34

    s, row = stage_row(Runner(), "m", None, "Method", lambda s: s["final"]["params"], note="x")
    assert s == {"final": {"params": 7.0}}
    assert row == method_row("m", "Method", ["m"], [0.5, 1.0], 12.34, 7.0, note="x")
    assert list(row) == ["method", "label", "runs", "client_test_acc", "mean", "std", "min", "max", "params",
                         "wall_s", "note"]
    assert (row["mean"], row["min"], row["wall_s"]) == (0.75, 0.5, 12.3)
    assert stage_row(Runner(), "m", None, "Method", 3.0)[1]["params"] == 3.0


def test_describe_round_shows_the_round_metrics_an_algorithm_reports():
    from jaxfednas.stages import describe_round

    assert describe_round({"train_loss": 0.5, "global_test_acc": 0.25, "fixed_blocks": 3.0, "epsilon_pld": 1.23456,
                           "not_shown": 1.0}) == "train loss 0.5000, global test acc 0.2500, ε (PLD) 1.235, fixed blocks 3"
    assert describe_round({}) == ""


def test_once_or_over_seeds_runs_the_job_once_or_per_seed(tmp_path):
    import argparse

    from jaxfednas.seeds import once_or_over_seeds

    calls = []

    def one(overrides, out):
        calls.append((overrides, out))
        return {"numbers": {"x": float(overrides.get("run.seed", -1))}}

    args = argparse.Namespace(seeds=None, out=str(tmp_path / "one"), overrides={"algo.lr": 0.1})
    assert once_or_over_seeds(args, one) == {None: {"numbers": {"x": -1.0}}}
    assert calls == [({"algo.lr": 0.1}, tmp_path / "one")]
    calls.clear()
    args = argparse.Namespace(seeds="1,3", out=str(tmp_path / "many"), overrides={"algo.lr": 0.1})
    once_or_over_seeds(args, one, {"algo.lr": 0.2}, title="t")
    assert calls == [({"algo.lr": 0.2, "run.seed": s}, tmp_path / "many" / f"seed_{s}") for s in (1, 3)]
    assert "| x | 2.0000 ± 1.4142 | 1.0000 | 3.0000 |" in (tmp_path / "many" / "results.md").read_text()


def test_dp_fnas_sampling_probs_give_each_party_the_expected_batch():
    from jaxfednas.algorithms.dp_fnas import sampling_probs

    manifest = {"clients": [{"train": list(range(100)), "val": list(range(20))},
                            {"train": list(range(300)), "val": list(range(60))}]}
    assert sampling_probs(manifest, 16) == (16 * 2 / 400, 16 * 2 / 80)  # B over the parties' mean size
    assert sampling_probs(manifest, 1000) == (1.0, 1.0)  # (at most 1)
