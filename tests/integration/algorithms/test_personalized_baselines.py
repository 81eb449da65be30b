"""The personalized baselines of FedNAS Table 1: local adaptation, Ditto, Per-FedAvg.

Exact checks on a tiny CNN (one 4-channel conv, 8 hidden units) over the 4-client
synthetic ``tiny_data``; with ``batch_size`` above every client's size a local epoch is
one step on the client's whole train split, so results can be recomputed by hand.
"""
import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfednas.algorithms.common import make_local_train
from jaxfednas.algorithms.ditto import DittoConfig, ditto, make_personal_train
from jaxfednas.algorithms.fedavg import FedAvgConfig, fedavg
from jaxfednas.algorithms.local_adaptation import LocalAdaptationConfig, local_adaptation
from jaxfednas.search_spaces.models import CNN, init_variables
from jaxfednas.algorithms.perfedavg import PerFedAvgConfig, make_adapt, make_meta_step, make_outer_optimizer, perfedavg
from jaxfednas.experiment import run_experiment
from jaxfednas import rng
from jaxfednas.run_options import RunOptions
from jaxfednas.runtime import Placement, sample_clients, weighted_mean
from conftest import assert_accuracy, assert_client_summary, assert_summary_consistent

VMAP = Placement("vmap")
BIG = 256  # > any tiny_data client's train size: one step per epoch on all its data


def _model():
    return CNN(10, features=(4,), hidden=8)


def _leaves_equal(a, b):
    chex.assert_trees_all_equal(a, b)  # raises, naming the first leaf that differs
    return True


def _close(a, b, **kw):
    chex.assert_trees_all_close(a, b, **kw)


def _same_accuracy(a, b, data):
    """Per-client test accuracies of the same weights computed by two different compiled
    programs (or with per-client weight copies vs one shared copy, which vmap turns into a
    different convolution): the logits agree to float noise, whose reduction order depends
    on the program and the processor, so a near-tie may flip one prediction. Equal up to
    one test example per client, not bitwise."""
    a, b = np.asarray(a), np.asarray(b)
    n = np.asarray(data.test.counts, np.float64)
    assert np.array_equal(np.isnan(a), np.isnan(b))
    ok = ~np.isnan(a)
    assert np.all(np.abs(a[ok] - b[ok]) * n[ok] <= 1 + 1e-6), (a, b)


def _dist(a, b):
    return float(sum(jnp.sum((x - y) ** 2) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))) ** 0.5)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _mean_ce_grad(model, info, params, client):
    """∇ of the mean cross entropy over a client's whole split (no batching)."""
    mask = jnp.arange(client.y.shape[0]) < client.count

    def loss(p):
        logits = model.apply({"params": p}, info.normalize(client.x), train=True, mask=mask)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, client.y) * mask
        return ce.sum() / client.count

    return jax.grad(loss)(params)


# --- local adaptation ----------------------------------------------------------------


def test_local_adaptation_rounds_are_fedavg_and_eval_is_deterministic(tiny_data):
    cfg = LocalAdaptationConfig(batch_size=16, finetune_epochs=2)
    la = local_adaptation(cfg, tiny_data.info, run=RunOptions(clients_per_round=2, placement=VMAP), model=_model())
    fa = fedavg(FedAvgConfig(batch_size=16), tiny_data.info, run=RunOptions(clients_per_round=2, placement=VMAP), model=_model())
    key = jax.random.PRNGKey(3)
    s_la, m_la = la.round(la.init(jax.random.PRNGKey(0)), tiny_data, key)
    s_fa, m_fa = fa.round(fa.init(jax.random.PRNGKey(0)), tiny_data, key)
    # la.round is a second instance of FedAvg's round: the same program, so bitwise equal.
    assert _leaves_equal(s_la.variables, s_fa.variables)
    assert float(m_la["train_loss"]) == float(m_fa["train_loss"])

    e1, e2 = la.evaluate(s_la, tiny_data), la.evaluate(s_la, tiny_data)
    assert all(np.array_equal(e1[k], e2[k], equal_nan=True) for k in e1)
    # The global model's per-client numbers are FedAvg's own; fine-tuning changes them.
    _same_accuracy(e1["client_test_acc_global"], fa.evaluate(s_fa, tiny_data)["client_test_acc"], tiny_data)
    assert e1["client_test_acc"].shape == (4,)
    assert not np.array_equal(e1["client_test_acc"], e1["client_test_acc_global"])
    assert_accuracy(e1["global_test_acc"], tiny_data.server_y.shape[0])
    assert_client_summary(e1, tiny_data.all_clients("test").count)
    assert_client_summary(e1, tiny_data.all_clients("test").count, tag="_global")


# --- Ditto ---------------------------------------------------------------------------


def test_ditto_personal_step_by_hand(tiny_data):
    """λ = 0 is local training; one step (B > n_k, no momentum/decay) is v − η(∇F(v) + λ(v − w))."""
    info, model = tiny_data.info, _model()
    v = init_variables(model, jax.random.PRNGKey(1), info.image_shape)
    w = init_variables(model, jax.random.PRNGKey(2), info.image_shape)
    client, key = tiny_data.clients("train", jnp.int32(1)), jax.random.PRNGKey(9)

    cfg0 = DittoConfig(batch_size=16, local_epochs=2, prox_lambda=0.0)
    got, metrics = jax.jit(make_personal_train(model, info, cfg0))(v, w, client, key)
    ref, ref_metrics = jax.jit(make_local_train(model, info, cfg0))(v, client, key)
    _close(got, ref, rtol=1e-6, atol=1e-7)
    assert int(metrics["steps"]) == int(ref_metrics["steps"]) > 2

    cfg = DittoConfig(batch_size=BIG, prox_lambda=3.0, lr=0.1, momentum=0.0, weight_decay=0.0)
    got, _ = jax.jit(make_personal_train(model, info, cfg))(v, w, client, key)
    g = _mean_ce_grad(model, info, v["params"], client)
    expect = jax.tree.map(lambda p, gi, a: p - 0.1 * (gi + 3.0 * (p - a)), v["params"], g, w["params"])
    _close(got["params"], expect, rtol=2e-5, atol=1e-6)


def test_ditto_proximal_term_pulls_toward_global(tiny_data):
    info, model = tiny_data.info, _model()
    v = init_variables(model, jax.random.PRNGKey(1), info.image_shape)
    w = init_variables(model, jax.random.PRNGKey(2), info.image_shape)
    client, key = tiny_data.clients("train", jnp.int32(0)), jax.random.PRNGKey(4)
    dist = {}
    for lam in (0.0, 5.0):
        cfg = DittoConfig(batch_size=8, local_epochs=2, prox_lambda=lam, lr=0.1, momentum=0.0)
        out, _ = jax.jit(make_personal_train(model, info, cfg))(v, w, client, key)
        dist[lam] = _dist(out["params"], w["params"])
    assert dist[5.0] < 0.5 * dist[0.0]


def test_ditto_round(tiny_data):
    info, model = tiny_data.info, _model()
    cfg = DittoConfig(batch_size=16, prox_lambda=0.5)
    algo = ditto(cfg, info, run=RunOptions(clients_per_round=2, placement=VMAP), model=model)
    fa = fedavg(FedAvgConfig(batch_size=16), info, run=RunOptions(clients_per_round=2, placement=VMAP), model=model)
    s0 = algo.init(jax.random.PRNGKey(0))
    # FedAvg's initial model (two compiled programs: equal up to float rounding, not bits)
    _close(s0.variables, fa.init(jax.random.PRNGKey(0)).variables, rtol=1e-6, atol=1e-7)
    for k in range(4):  # personal models start as copies of the initial global model
        assert _leaves_equal(jax.tree.map(lambda a: a[k], s0.personal), s0.variables)

    key = jax.random.PRNGKey(11)
    s1, metrics = algo.round(s0, tiny_data, key)
    f1, _ = fa.round(fa.init(jax.random.PRNGKey(0)), tiny_data, key)
    _close(s1.variables, f1.variables, rtol=1e-6, atol=1e-7)  # the global model is FedAvg's
    assert int(s1.round) == 1 and np.isfinite(metrics["personal_train_loss"])

    idx = sample_clients(rng.sample_key(key), 4, 2)
    personal_train = jax.jit(make_personal_train(model, info, cfg))
    for k, pk in zip(np.asarray(idx), rng.personal_keys(rng.client_keys(key, idx))):
        row = jax.tree.map(lambda a: a[k], s1.personal)
        expect, _ = personal_train(jax.tree.map(lambda a: a[k], s0.personal), s0.variables,
                                   tiny_data.clients("train", jnp.int32(k)), pk)
        _close(row, expect, rtol=1e-5, atol=1e-6)
    for k in set(range(4)) - set(np.asarray(idx).tolist()):  # unsampled rows untouched
        assert _leaves_equal(jax.tree.map(lambda a: a[k], s1.personal), jax.tree.map(lambda a: a[k], s0.personal))

    e = algo.evaluate(s1, tiny_data)
    _same_accuracy(e["client_test_acc_global"], fa.evaluate(f1, tiny_data)["client_test_acc"], tiny_data)
    assert e["client_test_acc"].shape == (4,)
    assert_accuracy(e["global_test_acc"], tiny_data.server_y.shape[0])
    assert_client_summary(e, tiny_data.all_clients("test").count)


# --- Per-FedAvg ----------------------------------------------------------------------


def test_perfedavg_meta_step_by_hand(tiny_data):
    info, model = tiny_data.info, _model()
    cfg = PerFedAvgConfig(batch_size=BIG, lr=0.05, inner_lr_multiple=3.0, weight_decay=0.01, momentum=0.9)
    alpha, beta = 0.15, 0.05
    w = init_variables(model, jax.random.PRNGKey(1), info.image_shape)["params"]
    d, d2 = tiny_data.clients("train", jnp.int32(0)), tiny_data.clients("train", jnp.int32(2))

    def batch(c):
        return {"x": c.x, "y": c.y, "mask": jnp.arange(c.y.shape[0]) < c.count}

    def g(p, c):  # ∇f = ∇CE + weight_decay · p
        return jax.tree.map(lambda gi, pi: gi + 0.01 * pi, _mean_ce_grad(model, info, p, c), p)

    temp = jax.tree.map(lambda p, gi: p - alpha * gi, w, g(w, d))
    expect = jax.tree.map(lambda p, gi: p - beta * gi, w, g(temp, d2))

    meta_step = make_meta_step(model, info, cfg)
    opt_state = make_outer_optimizer(cfg).init(w)  # SGD β, momentum 0.9: the first step is plain
    (got, _, _), metrics = jax.jit(meta_step)((w, {}, opt_state), batch(d), batch(d2), jax.random.PRNGKey(0))
    _close(got, expect, rtol=2e-5, atol=1e-6)
    assert int(metrics["examples"]) == int(d2.count)


def test_perfedavg_round_by_hand(tiny_data):
    """B > n_k: each client's one step has D = D' = its whole train split; the server
    takes the n_k-weighted mean."""
    info, model = tiny_data.info, _model()
    cfg = PerFedAvgConfig(batch_size=BIG, lr=0.05, inner_lr_multiple=5.0, weight_decay=0.0)
    algo = perfedavg(cfg, info, run=RunOptions(clients_per_round=3, placement=VMAP), model=model)
    s0 = algo.init(jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(5)
    s1, metrics = algo.round(s0, tiny_data, key)

    idx = sample_clients(rng.sample_key(key), 4, 3)
    w = s0.variables["params"]
    per_client = []
    for k in np.asarray(idx):
        c = tiny_data.clients("train", jnp.int32(k))
        temp = jax.tree.map(lambda p, gi: p - 0.25 * gi, w, _mean_ce_grad(model, info, w, c))
        per_client.append(jax.tree.map(lambda p, gi: p - 0.05 * gi, w, _mean_ce_grad(model, info, temp, c)))
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_client)
    _close(s1.variables["params"], weighted_mean(stacked, tiny_data.train.counts[idx]), rtol=2e-5, atol=1e-6)
    assert int(metrics["local_steps"]) == 3

    e1, e2 = algo.evaluate(s1, tiny_data), algo.evaluate(s1, tiny_data)
    assert all(np.array_equal(e1[k], e2[k], equal_nan=True) for k in e1)
    assert not np.array_equal(e1["client_test_acc"], e1["client_test_acc_global"])
    no_adapt_cfg = PerFedAvgConfig(batch_size=BIG, adapt_steps=0)
    no_adapt = perfedavg(no_adapt_cfg, info, run=RunOptions(placement=VMAP), model=model)
    e0 = no_adapt.evaluate(s1, tiny_data)
    _same_accuracy(e0["client_test_acc"], e0["client_test_acc_global"], tiny_data)
    # zero adaptation steps hand back the global weights themselves (data movement: exact)
    adapted = make_adapt(model, info, no_adapt_cfg)(s1.variables, tiny_data.clients("train", jnp.int32(0)),
                                                     jax.random.PRNGKey(0))
    assert _leaves_equal(adapted, {"params": s1.variables["params"], "batch_stats": s1.variables["batch_stats"]})


# --- through the experiment runner ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local_adaptation", "ditto", "perfedavg"])
def test_runs_two_rounds(tmp_path, name):
    from jaxfednas.registry import make_config

    cfg = make_config(name, overrides={
        "data.dataset": "synthetic", "data.num_clients": 4, "run.clients_per_round": 2, "run.rounds": 2,
        "run.placement": "vmap", "algo.batch_size": 64, "algo.local_epochs": 1,
    })
    run_experiment(cfg, tmp_path / name, progress=False, log=lambda s: None)
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["algorithm"] == name
    final = summary["final"]
    assert_summary_consistent(tmp_path / name)
    assert "client_test_acc_global_mean_unweighted" in final
    assert len((tmp_path / name / "clients.csv").read_text().splitlines()) == 5
