"""One name, one meaning: the glossary of every metric an algorithm reports.

``round`` and ``evaluate`` return dicts of metrics, ``host_metrics`` and ``personalize``
too; run directories keep them in ``metrics.jsonl``. Each name below means the same thing
in every algorithm that reports it, so a table across algorithms compares like with like
(tests/integration/algorithms/test_contract.py checks every name each algorithm reports is here).

A per-client metric (a vector with one entry per client, NaN where the client has no
examples in that split) comes with four summaries named by a suffix (:data:`SUFFIXES`):
``client_test_acc_mean_weighted`` is the mean of ``client_test_acc`` weighted by each
client's test-split size.

Vocabulary: *global model* is the model the server holds (a supernet for FedNAS, DP-FNAS,
SPIDER and PerFedRLNAS, the child argmax(α) inside the supernet for DFNAS, the network
itself for the baselines); *BN* a BatchNorm layer's statistics, by default the running
statistics averaged by the server; *the round's clients* the clients sampled in the round.
"""
from __future__ import annotations

#: The summaries of a per-client metric, name suffix -> what it is (the tables of
#: :doc:`/glossary`).
#:
#: :meta hide-value:
SUFFIXES: dict[str, str] = {
    "_mean_unweighted": "mean over the clients with examples in the split",
    "_std_unweighted": "standard deviation over the clients with examples in the split",
    "_mean_weighted": "mean weighted by each client's number of examples in the split",
    "_std_weighted": "standard deviation weighted by each client's number of examples in the split",
}

#: Per-client metrics, each of which also appears with every suffix of :data:`SUFFIXES`:
#: name -> meaning.
#:
#: :meta hide-value:
PER_CLIENT: dict[str, str] = {
    "client_test_acc": "each client's model (the global model, or the client's personal model where the "
                       "algorithm has one) on the client's own test split",
    "client_val_acc": "as client_test_acc, on the client's validation split",
    "client_test_acc_global": "the global model on each client's test split, beside a personalized client_test_acc",
    "client_test_acc_final": "personalize: each client's model after its last local adaptation epoch, on its test "
                             "split (client_test_acc is the epoch its validation split selected)",
    "client_test_acc_bn_recal": "as client_test_acc with BN statistics re-estimated on the clients' training "
                                "examples (federated recalibration; no test data used)",
}

#: Every other metric, name -> meaning.
#:
#: :meta hide-value:
GLOSSARY: dict[str, str] = {
    # training, every algorithm's round
    "train_loss": "mean training loss over every example the round's clients trained on, all local epochs",
    "train_acc": "training accuracy over the same examples as train_loss",
    "train_examples": "training examples the round's clients processed (over all local epochs)",
    "local_steps": "local optimizer steps the round's clients took, summed",
    "clients_reported": "clients whose update reached the server this round",
    "server_update_skipped": "1 if the server kept its model this round (no client reported), else 0",
    "lr": "the weight learning rate in effect this round (after its schedule)",
    "personal_train_loss": "training loss of the clients' personal models (Ditto v_k, SPIDER's personal supernet)",
    "personal_train_acc": "training accuracy of the clients' personal models",
    # global evaluation
    "global_test_acc": "the global model on the global test set, BN with the server's averaged running statistics",
    "global_test_loss": "mean cross entropy of the global model on the global test set",
    "global_test_acc_bn_batch": "as global_test_acc, BN normalising each test batch by its own statistics "
                                "(isolates the lag of running statistics)",
    "global_test_acc_bn_recal": "as global_test_acc with BN statistics re-estimated on the clients' training "
                                "examples (federated recalibration; no test data used)",
    # architecture search
    "arch_entropy": "mean entropy (nats) of softmax(α) over the architecture's decisions (ln n: uniform, 0: decided)",
    "search_val_acc": "accuracy of the architecture step's validation batches (the clients' own validation "
                      "splits), averaged over the round",
    "search_val_loss": "loss of the architecture step's validation batches, averaged over the round",
    "fixed_blocks": "DFNAS: blocks fixed to their argmax so far (DSNAS early fixing)",
    "expected_macs": "DFNAS: expected multiply-adds of a sampled child under softmax(α), fixed blocks at "
                     "their choice",
    "child_macs": "DFNAS: multiply-adds of the child argmax(α)",
    "personal_epoch": "personalize: the adaptation epoch each client's validation split selected (0: the global model)",
    "client_test_acc_by_epoch": "personalize: each client's test accuracy after each adaptation epoch "
                                "(clients x epochs+1; column 0 the global model)",
    "client_val_acc_by_epoch": "personalize: as client_test_acc_by_epoch, on the validation splits",
    # SPIDER
    "edges_decided": "SPIDER: fraction of the personal architectures' edges already decided, over all clients",
    "final_clients": "SPIDER: clients whose personal architecture is final",
    "searching_clients": "SPIDER: clients that ran a search step this round",
    "supernet_params": "parameters of the global supernet",
    "personal_params_mean": "mean over clients of the parameters their personal architecture keeps",
    # PerFedRLNAS
    "reward_acc": "PerFedRLNAS: mean accuracy term of Eq. 8's reward over the reporting clients",
    "reward_mean": "PerFedRLNAS: mean reward r_i (Eq. 8/9) over the reporting clients",
    "reward_time_share": "PerFedRLNAS: Σ|time term| / Σ|r_i| over the reporting clients",
    "acc_baseline": "PerFedRLNAS: the reward baseline (mean accuracy of Eq. 8)",
    "round_time_s": "PerFedRLNAS: simulated round time in seconds: the slowest reporting client's compute + transfer",
    "over_budget": "PerFedRLNAS: the round's clients whose subnet exceeds their memory budget",
    "policy_entropy": "PerFedRLNAS: former name of arch_entropy (the clients' policies; the same number, "
                      "removed in the next release)",
    "subnet_params": "PerFedRLNAS: mean parameters of the reporting clients' sampled subnets",
    "reported_acc_mean": "PerFedRLNAS: mean over the clients seen so far of their latest reported accuracy",
    "best_reported_acc_mean": "PerFedRLNAS: mean over the clients seen so far of their best reported accuracy "
                              "(the code's logged number)",
    "personal_macs_mean": "PerFedRLNAS: mean multiply-adds of each client's argmax subnet",
    "client_memory_mb": "PerFedRLNAS: each client's training memory of its argmax subnet, MB (per client)",
    "client_memory_budget_mb": "PerFedRLNAS: each client's memory budget, MB (per client)",
    "client_throughput_gmacs": "PerFedRLNAS: each client's simulated throughput, giga multiply-adds/s (per client)",
    # DP-FNAS: Algorithm 1 iterations, sampling, clipping
    "iterations": "DP-FNAS: Algorithm 1 iterations done so far",
    "iterations_run": "DP-FNAS: iterations this round ran (fewer than iterations_per_round at the budget)",
    "max_iterations": "DP-FNAS: the iteration cap target_epsilon allows (a huge number without a budget)",
    "budget_exhausted": "DP-FNAS: 1 once the privacy budget stops the search",
    "train_sampled": "DP-FNAS: training examples Poisson-sampled this round, over parties and iterations",
    "val_sampled": "DP-FNAS: validation examples Poisson-sampled this round",
    "train_overflow": "DP-FNAS: sampled training examples dropped for want of a batch slot (should be 0)",
    "val_overflow": "DP-FNAS: sampled validation examples dropped for want of a batch slot",
    "train_clipped_frac": "DP-FNAS: fraction of per-example weight gradients the clip norm R^G shortened",
    "val_clipped_frac": "DP-FNAS: fraction of per-example architecture gradients the clip norm R^H shortened",
    # DP-FNAS privacy (host_metrics; each epsilon named by the accountant that computed it)
    "mu_train": "DP-FNAS: Gaussian-DP μ of the weight mechanism so far (CLT for Poisson subsampling)",
    "mu_val": "DP-FNAS: Gaussian-DP μ of the architecture mechanism so far",
    "epsilon_pld": "DP-FNAS: ε at delta of the whole search by the PLD accountant (dp-accounting): the "
                   "larger of the two mechanisms' (each party's data feeds one of them)",
    "epsilon_pld_train": "DP-FNAS: ε by the PLD accountant of the weight mechanism",
    "epsilon_pld_val": "DP-FNAS: ε by the PLD accountant of the architecture mechanism",
    "epsilon_rdp": "DP-FNAS: as epsilon_pld by the RDP accountant (a looser upper bound)",
    "epsilon_rdp_train": "DP-FNAS: ε by the RDP accountant of the weight mechanism",
    "epsilon_rdp_val": "DP-FNAS: ε by the RDP accountant of the architecture mechanism",
    "epsilon_clt": "DP-FNAS: as epsilon_pld from the CLT's μ-GDP (the paper's accountant; an approximation, "
                   "not a bound)",
    "epsilon_clt_train": "DP-FNAS: ε from μ_train by the GDP CLT",
    "epsilon_clt_val": "DP-FNAS: ε from μ_val by the GDP CLT",
    "budget_epsilon": "DP-FNAS: the ε target_epsilon is checked against (that of algo.accountant)",
    "overflow_bound_train": "DP-FNAS: upper bound on the probability that a Poisson batch of the weight "
                            "mechanism overflowed its slots during the run",
    "overflow_bound_val": "DP-FNAS: as overflow_bound_train for the architecture mechanism",
}


def meaning(name: str) -> str:
    """What metric ``name`` means; ``KeyError`` for a name the glossary lacks."""
    if name in GLOSSARY:
        return GLOSSARY[name]
    if name in PER_CLIENT:
        return PER_CLIENT[name] + " (per client)"
    for suffix, what in SUFFIXES.items():
        base = name.removesuffix(suffix)
        if base != name and base in PER_CLIENT:
            return f"{what} of {base}"
    raise KeyError(f"metric {name!r} is not in jaxfednas.metrics.GLOSSARY")


def unknown(names) -> list[str]:
    """The names among ``names`` the glossary does not define."""
    out = []
    for n in names:
        try:
            meaning(n)
        except KeyError:
            out.append(n)
    return sorted(out)


def glossary_markdown() -> str:
    """The glossary as a Markdown table (the docs' metrics page)."""
    lines = ["| metric | meaning |", "|---|---|"]
    for name in sorted({**GLOSSARY, **PER_CLIENT}):
        what = GLOSSARY.get(name) or PER_CLIENT[name] + " (per client; also with every suffix below)"
        lines.append(f"| `{name}` | {what} |")
    lines += ["", "| suffix of a per-client metric | summary |", "|---|---|"]
    lines += [f"| `{s}` | {w} |" for s, w in SUFFIXES.items()]
    return "\n".join(lines)
