"""SPIDER (algorithms/spider.py): the personal update of Eq. 4 against its formula over two
steps, the kept variables against the masked loss's gradient, the op choice of Algorithm 2
(both criteria) and the topology projection (both rules) against brute-force evaluations,
the search schedule at the paper's t_s and τ, per-client rows under client sampling, a whole
search to final genotypes through the runner (files, phase 3), the personalization gain of
Eq. 6, and one-line config errors.

The masked forward equals the hand-pruned network in tests/integration/search_spaces/test_darts_masks.py; one
compilation per round and bit-exact resume of every per-client row in tests/integration/algorithms/test_contract.py.
"""
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfednas.algorithms import spider as sp
from jaxfednas.config import ConfigError
from jaxfednas.experiment import run_experiment
from jaxfednas.stages import load_run
from jaxfednas.registry import build_algorithm, make_config
from jaxfednas.rng import init_key, round_key
from jaxfednas.runtime import round_clients
from jaxfednas.search_spaces.darts import supernet_of
from jaxfednas.search_spaces.darts.masks import CELLS

# Compiling a DARTS supernet dominates these tests' time on CPU: one reduction cell.
TINY = {"algo.C": 4, "algo.layers": 1, "algo.nodes": 2, "algo.primitives": "tiny", "algo.augment": "none"}
ONE_CELL = {"nodes": 1}  # one cell of two edges: the cheapest compile


def _cfg(**over):
    flat = {"data.dataset": "synthetic", "data.num_clients": 4, **TINY, **{f"algo.{k}": v for k, v in over.items()}}
    return make_config("spider", overrides=flat).algo


def _client(data, split, i):
    return jax.tree.map(lambda a: a[0], data.clients(split, jnp.asarray([i])))


def test_personal_steps_are_ce_gradient_plus_lambda_pull_to_the_received_w(tiny_data):
    """Algorithm 1, lines 12-18 over two steps (two local epochs of one whole-client batch, plain
    SGD): w_{s+1} = w_s − η_w ∇F(w_s, A) and v_{s+1} = v_s − η_v (∇F(v_s, A_k) + λ (v_s − w_share))
    on the kept ops, w_share fixed at the round's received w^t (not the in-round w_s);
    removed ops' weights unchanged."""
    cfg = _cfg(momentum=0.0, weight_decay=0.0, grad_clip=0.0, personal_grad_clip=0.0, prox_lambda=0.5, batch_size=512,
               local_epochs=2, **ONE_CELL)
    info = tiny_data.info
    net = supernet_of(cfg, info.num_classes)
    full = {c: jnp.asarray(m) for c, m in sp.initial_mask(net.primitives, cfg.nodes).items()}
    x0 = jnp.zeros((1,) + info.image_shape)
    init = jax.jit(sp._init_variables, static_argnums=0)
    w, v = init(net, full, jax.random.key(0), x0), init(net, full, jax.random.key(1), x0)
    mask = {c: np.array([[1, 0, 1], [0, 1, 1]], np.float32) for c in CELLS}  # edge 0 drops avg_pool, 1 skip
    client = _client(tiny_data, "train", 0)
    lr_w, lr_v, lam = 0.3, 0.2, 0.5

    train = sp.make_trainer(cfg, info, net, full)
    tx_v = sp.sgd(cfg.personal_grad_clip, cfg)
    w2, v2, _, metrics = jax.jit(train)(w, v, tx_v.init(v["params"]), sp.stack_cells(mask), client,
                                        jax.random.key(2), lr_w, lr_v)
    assert int(metrics["steps"]) == 2

    x, y, n = info.normalize(client.x), client.y, int(client.count)

    @jax.jit
    @jax.grad
    def ce(params, stats, arch):  # BatchNorm on batch statistics: the order of the batch does not matter
        logits, _ = sp.Subnet(net, arch).apply({"params": params, "batch_stats": stats}, x[:n], train=True,
                                               mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[:n]).mean()

    arch_v = {c: jnp.asarray(m) for c, m in mask.items()}
    keep = sp.variable_mask(mask, v["params"], net.primitives, cfg.nodes, cfg.layers)
    w_share, want_w, want_v = w["params"], w["params"], v["params"]
    for _ in range(2):
        gw, gv = ce(want_w, w["batch_stats"], full), ce(want_v, v["batch_stats"], arch_v)
        want_w = jax.tree.map(lambda p, g: p - lr_w * g, want_w, gw)
        want_v = jax.tree.map(lambda p, g, a, k: p - lr_v * k * (g + lam * (p - a)), want_v, gv, w_share, keep)
    for got, want in ((w2["params"], want_w), (v2["params"], want_v)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert any(np.any(np.asarray(k) == 0) for k in jax.tree.leaves(keep)), "the mask removes some op weights"
    frozen = jax.tree.map(lambda a, b, k: np.where(np.broadcast_to(k, a.shape) == 0, a - b, 0.0),
                          v2["params"], v["params"], keep)
    assert all(np.all(f == 0) for f in jax.tree.leaves(frozen)), "removed ops' weights moved"
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), w2["params"], w["params"])
    assert max(jax.tree.leaves(moved)) > 1e-3  # w moved within the round: w_share ≠ the in-round w


def test_variable_mask_is_the_set_of_variables_the_masked_loss_reads(tiny_data):
    """On a net with a normal and two reduction cells, the variables a mask keeps are exactly
    those whose gradient of the masked loss is not identically zero: weights, and BatchNorm
    running statistics through the eval-mode forward that reads them (each edge keeps some op,
    so every preprocessing layer is read)."""
    cfg = _cfg(layers=3, **ONE_CELL)  # cell 0 normal, cells 1 and 2 reduction
    info = tiny_data.info
    net = supernet_of(cfg, info.num_classes)
    mask = {"normal": np.array([[1, 0, 1], [0, 1, 0]], np.float32),  # ops: skip, avg_pool, sep_conv
            "reduce": np.array([[0, 0, 1], [1, 1, 0]], np.float32)}  # reduce skip = FactorizedReduce
    arch = {c: jnp.asarray(m) for c, m in mask.items()}
    # random values in the supernet's variable shapes (traced, not compiled: init's compile is the cost)
    x0 = jnp.zeros((1,) + info.image_shape)
    shapes = jax.eval_shape(lambda: sp._init_variables(net, arch, jax.random.key(5), x0))
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    v = jax.tree.unflatten(tree, [0.5 + jax.random.uniform(k, s.shape) for k, s in zip(keys, leaves)])
    x = info.normalize(tiny_data.train.x[0, :16])
    ct = jax.random.normal(jax.random.key(6), (16, info.num_classes))  # a random cotangent, not a loss after BN

    @jax.jit
    @jax.grad
    def grad(variables):
        return (sp.Subnet(net, arch).apply(variables, x, train=False) * ct).sum()

    g = grad(v)
    assert sorted(v["params"]) == ["cell_0", "cell_1", "cell_2", "classifier", "stem_bn", "stem_conv"]
    removed = 0
    for coll in ("params", "batch_stats"):
        keep = sp.variable_mask(mask, v[coll], net.primitives, cfg.nodes, cfg.layers)
        flat_g = jax.tree_util.tree_flatten_with_path(g[coll])[0]
        for (path, leaf), k in zip(flat_g, jax.tree.leaves(keep)):
            k = np.asarray(k)
            assert k.ndim == leaf.ndim, jax.tree_util.keystr(path)
            axes = tuple(i for i in range(leaf.ndim) if k.shape[i] == 1)  # the mask's granularity
            read = np.any(np.asarray(leaf) != 0, axis=axes, keepdims=True).reshape(k.shape)
            np.testing.assert_array_equal(read, k != 0, err_msg=f"{coll} {jax.tree_util.keystr(path)}")
            removed += int((k == 0).sum())
    assert removed > 0, "the mask removes some variables"


def test_op_choice_keeps_the_op_whose_removal_hurts_most_or_the_printed_rule():
    acc_without = jnp.array([0.9, 0.4, 0.7, 0.1])
    present = jnp.array([True, True, True, False])  # op 3 is already gone: never chosen
    assert int(sp.op_choice(acc_without, present, "removal_hurts_most")) == 1
    assert int(sp.op_choice(acc_without, present, "paper_text")) == 0
    # ties go to the first op
    assert int(sp.op_choice(jnp.array([0.5, 0.5, 0.5]), jnp.ones(3, bool), "removal_hurts_most")) == 0


def _searcher_setup(tiny_data, **over):
    """The searcher's inputs on TINY (one reduction cell, 2 nodes): config, network, supernet
    weights, a client's labelled split. The same weights in every test: the persistent
    compilation cache serves the programs the tests share."""
    cfg = _cfg(**over)
    info = tiny_data.info
    net = supernet_of(cfg, info.num_classes)
    full = {c: jnp.asarray(m) for c, m in sp.initial_mask(net.primitives, cfg.nodes).items()}
    v = jax.jit(sp._init_variables, static_argnums=0)(net, full, jax.random.key(3), jnp.zeros((1,) + info.image_shape))
    return cfg, info, net, sp.stack_cells(full), v, _client(tiny_data, "test", 1)


def _hand_accuracy(info, net, v, val, b=0):
    """``acc(mask)``: the accuracy on all of ``val``, computed here in batches of ``b`` rows
    (0: one batch) with BatchNorm on each batch's statistics."""
    n = int(val.count)
    b = b or n
    rows = -(-n // b) * b
    x = info.normalize(jnp.concatenate([val.x[:n], jnp.zeros((rows - n,) + val.x.shape[1:], val.x.dtype)]))
    valid, y = np.arange(rows) < n, np.asarray(val.y[:n])
    # one compiled forward for every mask and batch (eagerly its ops compile ~80 small programs)
    forward = jax.jit(lambda m, xb, vb: sp.Subnet(net, sp.unstack_cells(m)).apply(
        v, xb, train=True, mask=vb, mutable=["batch_stats"])[0])

    def acc(m):
        logits = np.concatenate([forward(m, x[i:i + b], valid[i:i + b]) for i in range(0, rows, b)])[:n]
        return float((np.argmax(logits, -1) == y).sum()) / n

    return acc


@pytest.mark.parametrize("criterion,search_batch", [("removal_hurts_most", 0), ("paper_text", 8)])
def test_searcher_choice_matches_a_brute_force_evaluation(tiny_data, criterion, search_batch):
    """One trigger: on the edge it picked, the kept op is the argmin (argmax) of the validation
    accuracy with each op removed, computed here independently: over the whole split, or in
    batches of ``search_batch_size`` with BatchNorm on each batch's statistics."""
    cfg, info, net, mask, v, val = _searcher_setup(tiny_data, criterion=criterion, search_batch_size=search_batch)
    edge_done = jnp.zeros((2, mask.shape[1]), bool)
    node_done = jnp.zeros((2, cfg.nodes), bool).at[:, 0].set(True)
    new_mask, new_edges, new_nodes = jax.jit(sp.make_searcher(cfg, info, net))(v, mask, edge_done, node_done, val,
                                                                                jax.random.key(4))
    assert np.asarray(new_edges).sum() == 2, "one edge per cell type"
    np.testing.assert_array_equal(new_nodes, node_done)  # no projection before every op is chosen
    assert search_batch == 0 or int(val.count) % search_batch, "batches with a last partial one"
    acc = _hand_accuracy(info, net, v, val, search_batch)
    c = 1  # the network's one cell is a reduction cell, decided after the normal cell's edge
    e = int(np.flatnonzero(np.asarray(new_edges[c]))[0])
    base = mask.at[0].set(new_mask[0])
    cands = [base.at[c, e, j].set(0.0) for j in range(mask.shape[2])]
    accs = [acc(m) for m in cands]
    assert len(set(accs)) > 1, accs  # the removals make a difference here
    got = jax.jit(sp.make_val_accuracies(cfg, info, net))(v, jnp.stack(cands), val)
    np.testing.assert_allclose(got, accs, atol=1e-6)  # the searcher's evaluator
    kept = int(np.flatnonzero(np.asarray(new_mask[c, e]))[0])
    pick = np.argmin if criterion == "removal_hurts_most" else np.argmax
    assert accs[kept] == accs[int(pick(accs))], (accs, kept)
    assert np.asarray(new_mask[c]).sum() == mask[c].sum() - (mask.shape[2] - 1)  # one op left on edge e


def _decided(cfg, n_ops, ops):
    """A state after every op choice: edge e keeps op ``ops[e]`` in both cells, nodes open
    from node 1 (node 0 has only its two inputs)."""
    mask = jnp.stack([jax.nn.one_hot(jnp.asarray(ops), n_ops)] * 2)
    return mask, jnp.ones(mask.shape[:2], bool), jnp.zeros((2, cfg.nodes), bool).at[:, 0].set(True)


# Node 2 of a 3-node cell (4 incoming edges, slots 0-3): the validation accuracy of the
# node's edges left (a set of slots). Greedy drops slot 0 (0.75 with it removed), then,
# re-scoring the three left, slot 2 (0.875): keeps {1, 3}. One-shot ranks the four once
# (0.75, 0.625, 0.5, 0.125): drops 0, then 1: keeps {2, 3}.
LEFT_ACC = {(1, 2, 3): 0.75, (0, 2, 3): 0.625, (0, 1, 3): 0.5, (0, 1, 2): 0.125,
            (2, 3): 0.25, (1, 3): 0.875, (1, 2): 0.375}


@pytest.mark.parametrize("projection,kept", [("greedy", [(1, 3), (2, 3)]), ("one_shot", [(2, 3), (0, 1)])])
def test_topology_projection_drops_in_order_under_both_rules(projection, kept):
    """The searcher's topology projection on a node with 4 inputs, scored by a table (no
    network): greedy re-scores the edges left after each drop, one_shot ranks them once; with
    every removal tied, greedy drops the first edges, one_shot the later ones."""
    cfg = _cfg(nodes=3, projection=projection)
    n_ops = 3
    slots = np.asarray(sp.incoming_edges(3)[2])  # node 2's edges
    calls = []

    def accuracies(lut, candidates, val):  # the table rides as the "variables": one compile per rule
        present = candidates[:, :, slots].sum(-1) > 0  # [n, 2 cells, 4 slots]
        jax.debug.callback(lambda: calls.append(1))
        return lut[(present * (1 << np.arange(4))).sum(-1)].sum(-1)  # both cells' tables

    search = jax.jit(sp.make_search(cfg, n_ops, accuracies))
    mask, edge_done, node_done = _decided(cfg, n_ops, [2, 0, 2, 0, 2, 2, 0, 2, 0])
    node_done = node_done.at[:, 1].set(True)  # node 2 only: every trigger projects it
    for table, want in zip((LEFT_ACC, {}), kept):
        lut = np.full(16, 0.5, np.float32)  # other sets of edges left (the other cell's full set)
        for left, acc in table.items():
            lut[sum(1 << s for s in left)] = acc
        calls.clear()
        new_mask, new_edges, new_nodes = search(jnp.asarray(lut), mask, edge_done, node_done, None,
                                                jax.random.key(0))
        for c in range(2):
            left = tuple(int(s) for s in np.flatnonzero(np.asarray(new_mask[c, slots]).sum(-1) > 0))
            assert left == want, (table, c, left)
            others = [np.delete(np.asarray(m[c]), slots, 0) for m in (new_mask, mask)]
            np.testing.assert_array_equal(*others)  # the node's edges only
        assert np.asarray(new_nodes).all() and np.asarray(new_edges).all()
        assert len(calls) == (2 if projection == "one_shot" else 4)  # one evaluation per drop, or one per node


def test_searcher_projection_matches_a_brute_force_evaluation(tiny_data):
    """Node 1 of a 2-node cell (3 inputs: edges 2, 3, 4): the searcher drops the edge whose
    removal gives the highest validation accuracy, computed here independently; the normal
    cell is not in the one-cell network, so there its three removals tie and the first edge
    goes. (The default rule; the table test above covers both rules' order and ties.)"""
    cfg, info, net, _, v, val = _searcher_setup(tiny_data)  # the op-choice test's programs
    assert cfg.projection == "greedy"
    mask, edge_done, node_done = _decided(cfg, 3, [2, 2, 2, 0, 2])
    new_mask, _, new_nodes = jax.jit(sp.make_searcher(cfg, info, net))(v, mask, edge_done, node_done, val,
                                                                        jax.random.key(4))
    assert np.asarray(new_nodes).all()
    acc = _hand_accuracy(info, net, v, val)
    dropped = {}
    for c in range(2):
        accs = [acc(mask.at[c, e].set(0.0)) for e in (2, 3, 4)]
        want = 2 + accs.index(max(accs))  # the first among ties
        gone = [e for e in (2, 3, 4) if np.asarray(new_mask[c, e]).sum() == 0]
        assert gone == [want], (c, accs, gone)
        dropped[c] = (accs, want)
    assert len(set(dropped[0][0])) == 1 and dropped[0][1] == 2
    accs = dropped[1][0]
    assert accs.count(max(accs)) == 1 and min(accs) < max(accs), dropped  # the reduction cell: one best removal


def test_search_schedule_and_trigger_at_the_papers_t_s_and_tau(tiny_data):
    """t_s = 30, τ = 20, 4 nodes (14 edges): choices at a client's rounds 40, 60, ..., 300,
    topology projections at 300, 320, 340 (docs/authors_code.md §5.3); the round's trigger
    fires exactly there, following the search to its end."""
    cfg = make_config("spider").algo
    assert (cfg.warmup_rounds, cfg.recovery_rounds, cfg.nodes) == (30, 20, 4)
    schedule = sp.search_schedule(cfg)
    assert schedule == list(range(40, 341, 20)) and len(schedule) == 14 + 2
    due, done = [], 0
    for t in range(1000):  # one client's clock; its architecture is final after its 16th trigger
        if sp.search_due(cfg, np.int32(t), np.bool_(done == len(schedule))):
            due.append(t)
            done += 1
    assert due == schedule
    t = np.array([29, 30, 39, 40, 41, 60, 340])
    np.testing.assert_array_equal(sp.search_due(cfg, t, np.zeros(7, bool)), [0, 0, 0, 1, 0, 1, 1])
    assert not sp.search_due(cfg, np.int32(40), np.bool_(True))
    # t_s a multiple of τ: the first choice at t_s itself
    on = make_config("spider", overrides={"algo.warmup_rounds": 40}).algo
    assert sp.search_schedule(on)[0] == 40 and bool(sp.search_due(on, np.int32(40), np.bool_(False)))
    # a run that ends before the last projection (the client's round 341) warns
    for rounds, warns in ((340, True), (341, False)):
        config = make_config("spider", overrides={"run.rounds": rounds, **TINY, "algo.nodes": 4})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build_algorithm(config, tiny_data.info)
        assert any("round 341" in str(w.message) for w in caught) == warns, rounds


ROUNDS = 16


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A whole SPIDER run through the runner: 2 of 4 clients per round, each searching from
    its first round, one choice per participation (5 edges per cell with 2 nodes: final
    after a client's 5th round), then phase 3."""
    out = tmp_path_factory.mktemp("spider")
    cfg = make_config("spider", overrides={
        "data.dataset": "synthetic", "data.num_clients": 4, "run.rounds": ROUNDS, "run.clients_per_round": 2,
        **TINY, "algo.warmup_rounds": 0, "algo.recovery_rounds": 1})
    summary = run_experiment(cfg, out, progress=False, log=lambda s: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return cfg, out, summary, rows, load_run(out)


def _sampled(r):
    return np.asarray(round_clients(round_key(0, r), 4, 2)[0])


@pytest.mark.slow
def test_a_run_searches_every_client_to_a_genotype_and_writes_its_files(searched):
    cfg, out, summary, rows, _ = searched
    final = summary["final"]
    assert final["final_clients"] == 4 and final["edges_decided"] == 1.0
    archs = json.loads((out / "personal_genotypes.json").read_text())
    assert sorted(archs) == ["0", "1", "2", "3"]
    for k, a in archs.items():
        assert a["final"] and a["genotype"]["normal_concat"] == [2, 3]
        for c in CELLS:
            assert len(a["genotype"][c]) == 4  # two inputs per node, one op each
            assert sum(len(ops) for ops in a[c]) == 4
        assert (out / "plots" / f"client_{k}_reduce.png").exists()
    lines = (out / "clients.csv").read_text().splitlines()
    assert len(lines) == 5 and "test_acc" in lines[0]
    assert final["personal_params_mean"] < final["supernet_params"]
    # a client searches in each of its first 5 rounds (its own clock t = 0..4), then never again
    clock, searching = np.zeros(4, int), []
    for r in range(ROUNDS):
        ids = _sampled(r)
        searching.append(int((clock[ids] < 5).sum()))
        clock[ids] += 1
    assert [row["searching_clients"] for row in rows] == searching


@pytest.mark.slow
def test_phase_three_trains_on_train_plus_validation(searched):
    """A client whose architecture is final trains on its train and validation rows."""
    _, _, _, rows, run = searched
    train, val = np.asarray(run.data.train.counts), np.asarray(run.data.val.counts)
    clock = np.zeros(4, int)
    for r, row in enumerate(rows):
        ids = _sampled(r)
        final = clock[ids] >= 5  # searched in 5 earlier rounds (the 5th choice comes before training)
        final |= clock[ids] == 4
        assert row["train_examples"] == (train[ids] + np.where(final, val[ids], 0)).sum(), r
        clock[ids] += 1
    both = sp.combined_split(_client(run.data, "train", 0), _client(run.data, "val", 0), jnp.asarray(True))
    n_t, n_v = int(train[0]), int(val[0])
    assert int(both.count) == n_t + n_v
    np.testing.assert_array_equal(both.y[:n_t], run.data.train.y[0, :n_t])
    np.testing.assert_array_equal(both.y[n_t:n_t + n_v], run.data.val.y[0, :n_v])


@pytest.mark.slow
def test_gain_matrix_and_eq6(searched):
    _, _, _, _, run = searched
    p = sp.gain_matrix(run.config.algo, run.data.info, run.state, run.data, epochs=1)
    assert p.shape == (4, 4)
    counts = np.asarray(run.data.test.counts)
    for i in range(4):
        k = p[i] * counts[i]
        np.testing.assert_allclose(k, np.round(k), atol=1e-4)  # whole test examples
    g = sp.personalization_gain(p)
    want = [np.mean([p[i, i] - p[i, j] for j in range(4) if j != i]) for i in range(4)]
    np.testing.assert_allclose(g, want, atol=1e-12)
    np.testing.assert_allclose(sp.personalization_gain(np.array([[0.9, 0.5], [0.2, 0.6]])), [0.4, 0.4])
    with pytest.raises(ValueError, match="square"):
        sp.personalization_gain(np.ones((2, 3)))


@pytest.mark.slow
@pytest.mark.slow  # ~45 s on 2 cores: the suite's time is at its 10-minute limit
def test_fine_tuned_accuracy_is_the_gain_recipe_for_any_masks_per_client(searched):
    """Each client's own mask fine-tuned alone gives the gain matrix's diagonal (the same
    recipe and minibatches), and a row's candidates are the client's own: client i's second
    candidate is client (i + 1)'s architecture, p[i, i + 1]. kept_parameters is the size
    personal_params_mean averages."""
    _, _, summary, _, run = searched
    cfg, info, state = run.config.algo, run.data.info, run.state
    p = sp.gain_matrix(cfg, info, state, run.data, epochs=1)
    nxt = {c: jnp.roll(a, -1, axis=0) for c, a in state.arch_masks.items()}
    masks = {c: jnp.stack([state.arch_masks[c], nxt[c]], axis=1) for c in CELLS}  # [K, 2, E, |O|]
    acc = sp.fine_tuned_accuracy(cfg, info, state.variables, masks, run.data, epochs=1)
    assert acc.shape == (4, 2)
    np.testing.assert_allclose(acc[:, 0], np.diag(p), atol=1e-6)
    np.testing.assert_allclose(acc[:, 1], [p[i, (i + 1) % 4] for i in range(4)], atol=1e-6)
    sizes = [sp.kept_parameters(cfg, state.variables["params"], {c: state.arch_masks[c][k] for c in CELLS})
             for k in range(4)]
    assert np.mean(sizes) == pytest.approx(summary["final"]["personal_params_mean"])
    assert len(set(sizes)) > 1 or sizes[0] < summary["final"]["supernet_params"]


@pytest.mark.slow
def test_inherited_accuracy_recalibrates_batchnorm_exactly_under_each_mask(searched):
    """Each mask with the global supernet's weights (none moves) and BatchNorm statistics
    measured under that mask on the client's train + validation examples, by hand: the
    subnet in training mode on all of them as one batch, from zero statistics (Flax BN:
    ``(1 - m) x`` the batch's statistics), then the client's test split in evaluation mode."""
    from jaxfednas.evaluation import evaluate_examples
    from jaxfednas.search_spaces.darts import BN_MOMENTUM
    from jaxfednas.search_spaces.darts.masks import Subnet

    _, _, _, _, run = searched
    cfg, info, state = run.config.algo, run.data.info, run.state
    nxt = {c: jnp.roll(a, -1, axis=0) for c, a in state.arch_masks.items()}
    masks = {c: jnp.stack([state.arch_masks[c], nxt[c]], axis=1) for c in CELLS}  # [K, 2, E, |O|]
    got = sp.inherited_accuracy(cfg, info, state.variables, masks, run.data, max_batches=1000)
    net, params = supernet_of(cfg, info.num_classes), state.variables["params"]
    zeros = jax.tree.map(jnp.zeros_like, state.variables["batch_stats"])
    for i in range(4):
        one = lambda split: jax.tree.map(lambda a: a[0], run.data.clients(split, jnp.asarray([i])))  # noqa: E731
        train, val, test = one("train"), one("val"), one("test")
        x = jnp.concatenate([train.x[:int(train.count)], val.x[:int(val.count)]])
        for j in range(2):
            subnet = Subnet(net, {c: masks[c][i, j] for c in CELLS})
            moved = subnet.apply({"params": params, "batch_stats": zeros}, info.normalize(x), train=True,
                                 mutable=["batch_stats"])[1]["batch_stats"]
            stats = jax.tree.map(lambda a: a / (1.0 - BN_MOMENTUM), moved)
            logits = lambda v: subnet.apply({"params": params, "batch_stats": stats},  # noqa: E731, B023
                                            info.normalize(v), train=False)
            r = evaluate_examples(logits, test.x, test.y, test.count, batch_size=64)
            np.testing.assert_allclose(got[i, j], float(r["correct"] / r["count"]), atol=1e-6, err_msg=(i, j))
    assert got.shape == (4, 2) and ((got >= 0) & (got <= 1)).all()


@pytest.mark.slow
def test_unsampled_clients_rows_are_untouched_and_clocks_are_per_client(searched):
    _, _, _, _, run = searched
    algo, data = run.algorithm, run.data
    s0 = algo.init(init_key(0))
    s1, _ = algo.round(s0, data, round_key(0, 0))
    s2, m2 = algo.round(s1, data, round_key(0, 1))
    for r, (a, b) in enumerate(((s0, s1), (s1, s2))):
        ids = set(_sampled(r).tolist())
        for field in ("personal", "opt_state", "arch_masks", "edge_done", "node_done", "client_rounds"):
            for k in range(4):
                same = all(np.array_equal(np.asarray(x)[k], np.asarray(y)[k])
                           for x, y in zip(jax.tree.leaves(getattr(a, field)), jax.tree.leaves(getattr(b, field))))
                if k not in ids:
                    assert same, (r, k, field)
                elif field in ("personal", "client_rounds", "edge_done"):
                    assert not same, (r, k, field)  # a sampled client trains and (t_s = 0) searches
        np.testing.assert_array_equal(np.asarray(b.client_rounds) - np.asarray(a.client_rounds),
                                      [int(k in ids) for k in range(4)])
    # the search clock is the client's own: each sampled client made exactly its own number of choices
    np.testing.assert_array_equal(np.asarray(s2.edge_done).sum((1, 2)), 2 * np.asarray(s2.client_rounds))
    assert int(m2["searching_clients"]) == 2


@pytest.mark.slow
def test_the_round_triggers_the_search_on_each_clients_own_clock_with_tau_above_one(searched):
    """t_s = 2, τ = 2 and unequal clocks: of the round's two sampled clients, the one whose
    own clock is 2 (>= t_s, a multiple of τ) makes a choice and the one at 3 does not; the
    unsampled clients (clock 4, due) do nothing; the server's round (5) plays no part."""
    cfg, _, _, _, run = searched
    config = make_config("spider", overrides={
        "data.dataset": "synthetic", "data.num_clients": 4, "run.rounds": ROUNDS, "run.clients_per_round": 2,
        **TINY, "algo.warmup_rounds": 2, "algo.recovery_rounds": 2})
    algo, data = build_algorithm(config, run.data.info), run.data
    a, b = _sampled(0).tolist()
    clock = np.full(4, 4, np.int32)
    clock[a], clock[b] = 2, 3
    s0 = algo.init(init_key(0))
    s0 = s0.replace(client_rounds=jnp.asarray(clock), round=jnp.int32(5))
    s1, m1 = algo.round(s0, data, round_key(0, 0))
    chose = np.asarray(s1.edge_done).sum((1, 2)) - np.asarray(s0.edge_done).sum((1, 2))
    np.testing.assert_array_equal(chose, [2 * (k == a) for k in range(4)])  # one choice per cell type
    np.testing.assert_array_equal(np.asarray(s1.client_rounds) - clock, [int(k in (a, b)) for k in range(4)])
    assert int(m1["searching_clients"]) == 1


@pytest.mark.parametrize("key,value", [("algo.recovery_rounds", 0), ("algo.prox_lambda", -0.1), ("algo.warmup_rounds", -1),
                                       ("algo.criterion", "largest"), ("algo.projection", "best"),
                                       ("algo.search_batch_size", -1)])
def test_bad_settings_fail_with_one_line_naming_the_setting(key, value):
    with pytest.raises(ConfigError) as err:
        make_config("spider", overrides={key: value})
    msg = str(err.value)
    assert key.split(".")[1] in msg and "\n" not in msg
