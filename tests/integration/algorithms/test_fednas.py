"""FedNAS (Algorithm 1, Eq. 4/5), personalization (§2.5) and the evaluation stage on a
tiny DARTS space (C=4, 1-2 cells, 2 nodes, 3 ops) so the file stays fast on 2 cores."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfednas.algorithms.fednas import (cpu_scheduler, FedNASConfig, client_genotypes, fednas, make_local_search, make_supernet,
                               recalibrated_batch_stats)
from jaxfednas.algorithms.fednas_train import FedNASTrainConfig, fednas_train, resolve_genotype
from jaxfednas.config import ConfigError
from jaxfednas.data import make_federated_data
from jaxfednas.data import partition as part
from jaxfednas.data.datasets import load_dataset
from jaxfednas.data.federated import ClientData
from jaxfednas.evaluation import select_by_validation
from jaxfednas.experiment import make_partition, run_experiment
from jaxfednas.registry import build_algorithm, make_config
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import Placement, round_clients
from jaxfednas.search_spaces.darts import FEDNAS_V1, Genotype
from conftest import assert_accuracy, assert_client_summary

TINY = dict(C=4, layers=1, nodes=2, primitives="tiny", batch_size=16, local_epochs=1, personalize_epochs=1,
            eval_batch_size=64)


@pytest.fixture(scope="module")
def data2():
    """2 synthetic clients (8x8x1, 10 classes) with search-train / search-val / test splits."""
    cfg = make_config("fednas", overrides={"data.dataset": "synthetic", "data.num_clients": 2})
    assert cfg.data.split == (0.5, 0.25, 0.25)  # FedNAS's DEFAULTS give a validation split
    ds = load_dataset("synthetic", num_train=128, num_test=32)
    return make_federated_data(ds, part.manifest_splits(make_partition(cfg, ds)))


@pytest.fixture(scope="module")
def algo_and_states(data2):
    cfg = FedNASConfig(**TINY, arch_lr=0.05)  # a large α step so averaging is visible
    algo = fednas(cfg, data2.info, run=RunOptions(placement=Placement("map")))
    s0 = algo.init(jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(7)
    s1, metrics = algo.round(s0, data2, key)
    return cfg, algo, s0, s1, metrics, key


@pytest.fixture(scope="module")
def local_search(data2, algo_and_states):
    """The fixture's ClientLocalSearch, compiled once for the tests that run it on one client."""
    cfg = algo_and_states[0]
    return jax.jit(make_local_search(cfg, data2.info, make_supernet(cfg, data2.info), cfg.local_epochs))


def test_round_averages_weights_and_alpha_with_nk(data2, algo_and_states, local_search):
    cfg, algo, s0, s1, metrics, key = algo_and_states
    local = local_search
    idx, keys = round_clients(key, 2, 2)
    outs, n = [], []
    for j, k in enumerate(np.asarray(idx)):
        train = jax.tree.map(lambda a: a[k], data2.clients("train", jnp.arange(2)))
        val = jax.tree.map(lambda a: a[k], data2.clients("val", jnp.arange(2)))
        v, _ = local(s0.variables, train, val, keys[j])
        outs.append(v)
        n.append(int(train.count))
    w = np.array(n, np.float64) / sum(n)
    # the two clients really moved α apart, so a mean differs from either of them
    a0, a1 = (np.asarray(o["arch"]["alphas_normal"]) for o in outs)
    assert np.abs(a0 - a1).max() > 1e-3
    for got, c0, c1 in zip(jax.tree.leaves(s1.variables), jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_allclose(np.asarray(got), w[0] * np.asarray(c0) + w[1] * np.asarray(c1), rtol=2e-5, atol=2e-6)
    assert float(metrics["local_steps"]) > 0 and np.isfinite(float(metrics["train_loss"]))

    # parity option: the FedML bug broadcasts the first sampled client's α
    bug = fednas(FedNASConfig(**TINY, arch_lr=0.05, alpha_aggregation="client0"), data2.info,
                 run=RunOptions(placement=Placement("map")))
    s_bug, _ = bug.round(s0, data2, key)
    np.testing.assert_allclose(np.asarray(s_bug.variables["arch"]["alphas_normal"]), a0, rtol=1e-6)


def test_one_compilation_per_round_and_evaluate(data2, algo_and_states, count_traces):
    _, algo, s0, _, _, _ = algo_and_states
    state, _ = algo.round(s0, data2, jax.random.PRNGKey(0))
    algo.evaluate(state, data2)
    with count_traces() as traced:
        for r in range(1, 3):
            state, _ = algo.round(state, data2, jax.random.PRNGKey(r))
            out = algo.evaluate(state, data2)
    assert traced == []
    for k in ("global_test_acc", "global_test_acc_bn_batch", "global_test_acc_bn_recal",
              "client_val_acc_mean_unweighted", "client_val_acc_std_unweighted", "client_test_acc_mean_weighted",
              "arch_entropy"):
        assert np.isfinite(float(out[k])), k
    # by hand from the state's α (distinct values in every row, far above float64 rounding: no ties)
    arch = {k: np.asarray(a, np.float64) for k, a in state.variables["arch"].items()}
    assert sorted(arch) == ["alphas_normal", "alphas_reduce"]
    assert min(np.diff(np.sort(a, -1), axis=-1).min() for a in arch.values()) > 1e-9

    def softmax(a):
        e = np.exp(a - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    # arch_entropy: the mean over the two α matrices of their mean row entropy of softmax(α), in nats
    want = np.mean([-(softmax(a) * np.log(softmax(a))).sum(-1).mean() for a in arch.values()])
    np.testing.assert_allclose(float(out["arch_entropy"]), want, rtol=1e-5)

    # the exported genotype: DARTS' derivation (the tiny space has no 'none'): per node the two
    # incoming edges whose strongest op weighs most, strongest first, each with that op
    ops = ("skip_connect", "avg_pool_3x3", "sep_conv_3x3")

    def cell(a):
        w, gene, start = softmax(a), [], 0
        for node in range(2):
            rows = w[start:start + 2 + node]
            gene += [(ops[int(np.argmax(rows[j]))], int(j)) for j in np.argsort(-rows.max(-1), kind="stable")[:2]]
            start += 2 + node
        return tuple(gene)

    assert algo.export(state) == Genotype(normal=cell(arch["alphas_normal"]), normal_concat=(2, 3),
                                          reduce=cell(arch["alphas_reduce"]), reduce_concat=(2, 3))


def test_bn_recalibration_pools_the_clients_training_statistics(data2, algo_and_states):
    cfg, _, _, s1, _, _ = algo_and_states
    model = make_supernet(cfg, data2.info)
    stats = jax.jit(lambda v, d: recalibrated_batch_stats(
        model, data2.info, v, d, batch_size=10, max_batches=3, placement=Placement("map")))(s1.variables, data2)
    # by hand: the stem convolution's outputs on each client's first min(n_k, 3 x 10) training
    # examples (29 and 35 here: a partial last batch and a cap), all pooled together
    train = data2.all_clients("train")
    counts = np.minimum(np.asarray(train.count), 30)
    assert counts.tolist() == [29, 30]
    x = jnp.concatenate([data2.info.normalize(train.x[k, :n]) for k, n in enumerate(counts)])
    y = np.asarray(jax.lax.conv_general_dilated(x, s1.variables["params"]["stem_conv"]["kernel"], (1, 1),
                                                ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")),
                   np.float64)
    got = stats["stem_bn"]
    np.testing.assert_allclose(np.asarray(got["mean"]), y.mean((0, 1, 2)), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["var"]), y.var((0, 1, 2)), rtol=1e-4)
    # every BatchNorm re-estimated: none keeps the running statistics of the search
    for new, old in zip(jax.tree.leaves(stats), jax.tree.leaves(s1.variables["batch_stats"])):
        assert new.shape == old.shape and np.abs(np.asarray(new) - np.asarray(old)).max() > 1e-3
    # 0 switches the metric off (traced only); negative is a config error
    off = fednas(FedNASConfig(**TINY, bn_recalibration_batches=0), data2.info, run=RunOptions(placement=Placement("map")))
    assert "global_test_acc_bn_recal" not in jax.eval_shape(off.evaluate, s1, data2)
    with pytest.raises(ConfigError, match="bn_recalibration_batches"):
        FedNASConfig(bn_recalibration_batches=-1)


def test_bn_stats_updates_code_replays_the_authors_three_updates(data2, algo_and_states, local_search):
    # one local step: a training split of 16 examples (one full batch) and a validation split of
    # 12 real rows (a partial batch: n counts only the real rows), in the fixture's padded shapes
    cfg, _, _, s1, _, _ = algo_and_states
    tr, va = data2.all_clients("train"), data2.all_clients("val")
    train = ClientData(x=tr.x[0], y=tr.y[0], count=jnp.asarray(16, tr.count.dtype))
    val = ClientData(x=va.x[0], y=va.y[0], count=jnp.asarray(12, va.count.dtype))
    key = jax.random.PRNGKey(5)

    # by hand: the stem BatchNorm normalises the stem convolution of the (unaugmented) batches;
    # its batch statistics depend on w only: the same in the α forwards and in the w forward
    def stem(x):
        y = jax.lax.conv_general_dilated(data2.info.normalize(x), s1.variables["params"]["stem_conv"]["kernel"],
                                         (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = np.asarray(y, np.float64)
        return y.mean((0, 1, 2)), y.var((0, 1, 2)), y[..., 0].size

    (mu_tr, var_tr, n_tr), (mu_val, var_val, n_val) = stem(train.x[:16]), stem(val.x[:12])
    assert (n_tr, n_val) == (16 * 64, 12 * 64)
    r0 = {k: np.asarray(s1.variables["batch_stats"]["stem_bn"][k], np.float64) for k in ("mean", "var")}

    def updates(start, batches, m=0.9):  # PyTorch's momentum 0.1, once per batch
        for b in batches:
            start = m * start + (1 - m) * b
        return start

    # default: one update, from the training forward, with the biased variance (Flax)
    once = local_search(s1.variables, train, val, key)[0]["batch_stats"]["stem_bn"]
    np.testing.assert_allclose(once["mean"], updates(r0["mean"], [mu_tr]), rtol=5e-6, atol=1e-6)
    np.testing.assert_allclose(once["var"], updates(r0["var"], [var_tr]), rtol=5e-6)
    # the authors' code (with its order of the α and w steps): α forward on the training batch, α
    # forward on the validation batch, w forward on the training batch, each updating the
    # statistics with PyTorch's unbiased variance n/(n-1) var
    code_cfg = dataclasses.replace(cfg, bn_stats_updates="code", order="alpha_first")
    code = jax.jit(make_local_search(code_cfg, data2.info, make_supernet(code_cfg, data2.info), 1))(
        s1.variables, train, val, key)[0]["batch_stats"]["stem_bn"]
    unbiased = lambda v, n: v * n / (n - 1)  # noqa: E731
    want_var = updates(r0["var"], [unbiased(var_tr, n_tr), unbiased(var_val, n_val), unbiased(var_tr, n_tr)])
    assert np.abs(want_var / updates(r0["var"], [var_tr, var_val, var_tr]) - 1).min() > 1e-4  # n/(n-1) shows
    np.testing.assert_allclose(code["mean"], updates(r0["mean"], [mu_tr, mu_val, mu_tr]), rtol=5e-6, atol=1e-6)
    np.testing.assert_allclose(code["var"], want_var, rtol=5e-6)
    with pytest.raises(ConfigError, match="bn_stats_updates"):
        FedNASConfig(bn_stats_updates="thrice")


def test_unbiased_running_var_is_the_same_in_the_grouped_cell(data2, algo_and_states):
    # the grouped cell (group_edges, CPU default at 16x16 and more) updates its edges' running
    # variance itself: under the parity rule it must give what the edges' own BatchNorms give
    cfg, _, _, s1, _, _ = algo_and_states
    x = data2.info.normalize(data2.all_clients("train").x[0, :16])
    mask = jnp.arange(16) < 12

    def stats(group_edges):
        model = make_supernet(dataclasses.replace(cfg, group_edges=group_edges), data2.info)
        model = model.clone(unbiased_running_var=True)

        def f(v, x, mask):
            return model.apply(v, x, train=True, mask=mask, mutable=["batch_stats"])[1]["batch_stats"]

        return jax.jit(f)(s1.variables, x, mask)

    grouped, own = stats("on"), stats("off")
    assert jax.tree.structure(grouped) == jax.tree.structure(own)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grouped), jax.tree.leaves(own)):
        np.testing.assert_allclose(a, b, rtol=5e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_cpu_scheduler_follows_the_pass_layout(monkeypatch):
    # one loop body: the passes cannot overlap, so XLA's own (faster) scheduler; inline passes
    # would overlap under it, so the memory-optimised one; the environment still overrides
    from jaxfednas.runtime import CPU_COMPILER_OPTIONS, compiler_options
    monkeypatch.delenv("JAXFEDNAS_CPU_SCHEDULER", raising=False)
    assert [cpu_scheduler(FedNASConfig(**TINY, passes=p)) for p in ("auto", "loop", "inline")] == [
        "default", "default", "memory"]
    memory_scheduler = CPU_COMPILER_OPTIONS.items()
    assert not (compiler_options(cpu_scheduler(FedNASConfig(**TINY))) or {}).items() & memory_scheduler
    assert compiler_options(cpu_scheduler(FedNASConfig(**TINY, passes="inline"))).items() >= memory_scheduler
    monkeypatch.setenv("JAXFEDNAS_CPU_SCHEDULER", "memory")
    assert compiler_options(cpu_scheduler(FedNASConfig(**TINY))).items() >= memory_scheduler


def test_round_keeps_the_nested_cells_as_calls_where_they_run_grouped(data2, monkeypatch):
    # the grouped cells (CPU, images of 16x16 and more) are nested jits, one per cell shape: the
    # round and §2.5's adaptation compile with XLA's call-inliner off; the 8x8 edge scan inlines
    from jaxfednas.runtime import KEEP_CALLS_OPTIONS
    monkeypatch.delenv("JAXFEDNAS_CPU_KEEP_CALLS", raising=False)
    cfg = FedNASConfig(**TINY)
    for shape, group_edges, grouped in (((8, 8, 1), "auto", False), ((16, 16, 3), "auto", True),
                                        ((16, 16, 3), "off", False)):
        c, info = dataclasses.replace(cfg, group_edges=group_edges), dataclasses.replace(data2.info, image_shape=shape)
        assert make_supernet(c, info).runs_grouped(shape) == grouped
        algo = fednas(c, info)
        for program in (algo.round, algo.personalize):
            assert (program.options.items() >= KEEP_CALLS_OPTIONS.items()) == grouped, (shape, group_edges)


def test_select_by_validation_never_reads_test():
    val = jnp.array([[3, 5, 5, 4],   # tie at 1 and 2: the later
                     [0, 0, 0, 0],   # no validation examples: the last candidate
                     [9, 2, 2, 2]])  # the global model (candidate 0) wins
    test = jnp.array([[1, 2, 3, 9], [5, 6, 7, 8], [4, 9, 9, 9]])  # the test-best candidates are never picked
    idx, picked = select_by_validation(val, test)
    assert idx.tolist() == [2, 3, 0] and picked.tolist() == [3, 8, 4]
    # the same choice whatever the test numbers say
    assert select_by_validation(val, -test)[0].tolist() == [2, 3, 0]
    with pytest.raises(ValueError, match="one shape"):
        select_by_validation(val, test[:, :2])


def test_personalize_adapts_every_client(data2, algo_and_states):
    cfg, algo, _, s1, _, _ = algo_and_states
    rows, out = algo.personalize(s1, data2, jax.random.PRNGKey(3))
    an = np.asarray(rows["arch"]["alphas_normal"])
    assert an.shape == (2, 5, 3)  # a row of α per client
    g = np.asarray(s1.variables["arch"]["alphas_normal"])
    assert np.abs(an[0] - an[1]).max() > 0  # each client adapted on its own data
    assert out["client_test_acc"].shape == (2,) and out["client_test_acc_global"].shape == (2,)
    counts = data2.all_clients("test").count
    for tag in ("", "_global", "_final"):
        assert_client_summary(out, counts, tag=tag)
    # candidates: the global model and the model after each of the E = 1 epochs; each client
    # keeps the one best on its validation split, and its test accuracy is what is reported
    n_val, n_test = (np.asarray(data2.all_clients(s).count) for s in ("val", "test"))
    val_correct = np.rint(np.asarray(out["client_val_acc_by_epoch"]) * n_val[:, None]).astype(int)
    test_correct = np.rint(np.asarray(out["client_test_acc_by_epoch"]) * n_test[:, None]).astype(int)
    assert val_correct.shape == (2, 2)
    pick = np.asarray(out["personal_epoch"])
    assert pick.tolist() == np.asarray(select_by_validation(val_correct, test_correct)[0]).tolist()
    np.testing.assert_allclose(out["client_test_acc"], test_correct[[0, 1], pick] / n_test, rtol=1e-6)
    np.testing.assert_allclose(out["client_test_acc_global"], test_correct[:, 0] / n_test, rtol=1e-6)
    np.testing.assert_allclose(out["client_test_acc_final"], test_correct[:, -1] / n_test, rtol=1e-6)
    for k in range(2):  # the rows are the kept models: the global one when candidate 0 won
        assert (np.abs(an[k] - g).max() > 0) == (pick[k] > 0)
    genos = client_genotypes(cfg, rows["arch"])
    assert len(genos) == 2 and all(isinstance(x, Genotype) for x in genos)
    # deterministic in its key
    rows2, _ = algo.personalize(s1, data2, jax.random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(rows2["arch"]["alphas_normal"]), an)


def test_build_requires_a_validation_split():
    cfg = make_config("fednas", overrides={"data.split": (0.75, 0.0, 0.25)})
    with pytest.raises(ConfigError, match="validation split"):
        build_algorithm(cfg, None)
    with pytest.raises(ConfigError, match="algo.C=3 must be even"):  # not a ValueError from inside jit
        FedNASConfig(C=3)


def test_resolve_genotype_and_errors(tmp_path):
    assert resolve_genotype("FEDNAS_V1") == FEDNAS_V1
    assert resolve_genotype(FEDNAS_V1.to_json()) == FEDNAS_V1
    p = tmp_path / "g.json"
    p.write_text(FEDNAS_V1.to_json())
    assert resolve_genotype(str(p)) == FEDNAS_V1
    with pytest.raises(ConfigError, match="algo.genotype"):
        resolve_genotype("NOPE")
    with pytest.raises(ConfigError, match="algo.genotype"):
        FedNASTrainConfig(genotype='{"normal": []}')


def test_evaluation_stage_trains_the_derived_network(data2):
    g = Genotype(normal=(("sep_conv_3x3", 0), ("skip_connect", 1), ("avg_pool_3x3", 2), ("sep_conv_3x3", 0)),
                 normal_concat=(2, 3),
                 reduce=(("max_pool_3x3", 0), ("sep_conv_3x3", 1), ("skip_connect", 2), ("avg_pool_3x3", 1)),
                 reduce_concat=(2, 3))
    cfg = FedNASTrainConfig(genotype=g.to_json(), C=4, layers=2, batch_size=16, lr=0.05, eval_batch_size=64)
    algo = fednas_train(cfg, data2.info, run=RunOptions(placement=Placement("map")))
    s = algo.init(jax.random.PRNGKey(0))
    before = jax.tree.leaves(s.variables["params"])
    s, m = algo.round(s, data2, jax.random.PRNGKey(1))
    after = jax.tree.leaves(s.variables["params"])
    assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0 for a, b in zip(before, after))
    assert np.isfinite(float(m["train_loss"]))
    out = algo.evaluate(s, data2)
    assert_accuracy(out["global_test_acc"], data2.server_y.shape[0])


@pytest.mark.slow
def test_run_directory_has_architecture_and_cell_diagrams(tmp_path):
    overrides = {"data.dataset": "synthetic", "data.num_clients": 2, "run.rounds": 1, "run.placement": "map"}
    overrides.update({f"algo.{k}": v for k, v in TINY.items()})
    cfg = make_config("fednas", overrides=overrides)
    summary = run_experiment(cfg, tmp_path / "run", progress=False, log=lambda *_: None)
    arch = json.loads((tmp_path / "run" / "architecture.json").read_text())
    assert Genotype.from_dict(arch).steps == 2 and summary["architecture"] == arch
    assert (tmp_path / "run" / "plots" / "cell_normal.png").stat().st_size > 1000
    assert (tmp_path / "run" / "plots" / "cell_reduce.png").exists()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "architecture" in row and "arch_entropy" in row and "client_val_acc_std_unweighted" in row


def test_milenas_lambda_weighs_the_validation_gradient_of_the_alpha_step(data2, algo_and_states):
    """Eq. 4 with λ = 3: one local step (a batch holding the whole training split, the
    validation batch the whole validation split) moves α by Adam's first step,
    −η_α (g / (|g| + ε)) with g = ∇_α L_tr + λ ∇_α L_val at the starting (w, α), both
    gradients by hand on the real rows. The signs of g differ from those of λ = 1 (the
    default), λ = 0 and λ on the training term in several entries (the validation labels
    are shifted so that the two gradients disagree), so a λ that does not reach the step
    shows."""
    lam, eta = 3.0, 0.05
    _, _, s0, _, _, _ = algo_and_states
    cfg = FedNASConfig(**{**TINY, "batch_size": 64}, arch_lr=eta, arch_weight_decay=0.0, milenas_lambda=lam)
    model = make_supernet(cfg, data2.info)
    tr, va = (jax.tree.map(lambda a: a[0], data2.all_clients(s)) for s in ("train", "val"))
    va = va.replace(y=(va.y + 5) % data2.info.num_classes)  # labels that pull α elsewhere than the training ones
    assert tr.y.shape[0] <= 64 and va.y.shape[0] <= 64  # one step, every row in its batch
    local = jax.jit(make_local_search(cfg, data2.info, model, 1))
    v1, metrics = local(s0.variables, tr, va, jax.random.PRNGKey(3))
    assert int(metrics["steps"]) == 1

    def rows(split):
        n = int(split.count)
        return data2.info.normalize(split.x[:n]), split.y[:n]

    @jax.jit
    @jax.grad
    def grad_alpha(arch, x, y):  # BatchNorm on the batch's own statistics, as the step's forwards
        logits, _ = model.apply({**s0.variables, "arch": arch}, x, train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    a0 = s0.variables["arch"]
    g_tr, g_val = (grad_alpha(a0, *rows(s)) for s in (tr, va))
    np.testing.assert_array_equal(v1["arch"]["alphas_normal"], a0["alphas_normal"])  # one cell: a reduction cell
    for name in ("alphas_reduce",):
        gt, gv = np.asarray(g_tr[name], np.float64), np.asarray(g_val[name], np.float64)
        g = gt + lam * gv
        step = np.asarray(v1["arch"][name], np.float64) - np.asarray(a0[name], np.float64)
        clear = np.abs(g) > 1e-3 * np.abs(g).max()  # entries whose sign float rounding cannot flip
        np.testing.assert_allclose(step[clear], -eta * np.sign(g[clear]), rtol=1e-3)
        for other in (gt + gv, gt, lam * gt + gv):
            assert (np.sign(other[clear]) != np.sign(g[clear])).sum() >= 2, name
