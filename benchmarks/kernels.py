"""Kernels per FedNAS client-step on a GPU, counted without one (deviceless compilation).

XLA compiles each program for an NVIDIA H100 (``jaxfednas/h100_gpu_target.pbtxt``) on this
machine, and :func:`jaxfednas.kernels.count_kernels` counts the launches of its optimized
HLO: fusions, cuDNN convolutions by kind, GEMMs, copies, while-loop iterations (a predicate
read-back each) and conditionals (every branch counted: an upper bound). Programs are
traced as for a GPU (:func:`jaxfednas.nn.compile_for`): the GPU's depthwise formulation,
native gradients, no CPU scheduler. Parts (``--parts``):

* ``step``  -- one client's FedNAS local search (``make_local_search``, ``--steps`` MiLeNAS
  steps in a ``lax.scan``) at the paper's shapes (C=16, 8 cells, batch 64, 32x32x3) in each
  formulation of ``benchmarks/gpu.py`` (``--formulations``);
* ``round`` -- a FedNAS round of ``--round-clients`` clients with ``--chunks`` clients in
  flight (1: ``lax.map``, one at a time; a chunk: that many vmapped at once), the
  formulation ``--round-formulation``.

Per variant: kernels per client-step (the program's launches / its client-steps), cuDNN
calls by kind, GEMMs, copies, loop iterations, XLA's memory estimate (arguments, outputs
and temporaries: does a chunk fit an 80 GB H100?) and the compile time. A proxy, not a
time: only a GPU run times it (``benchmarks/gpu.py``).

Needs the CUDA plugin (no GPU, no driver)::

    python3.12 -m venv .venv-gpu && . .venv-gpu/bin/activate
    pip install -e . "jax[cuda13]==0.11.2"   # ~2.5 GB of wheels
    JAX_PLATFORMS=cpu python benchmarks/kernels.py --out kernels.md          # ~4 min a variant on 2 cores
    JAX_PLATFORMS=cpu python benchmarks/kernels.py --quick                   # tiny shapes, every code path
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import _bench_util as bu

bu.ensure_package_importable()
import gpu  # noqa: E402  (its step and round builders: the programs gpu.py times)

PARTS = ("step", "round")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="step,round", help=f"comma list from {PARTS}")
    p.add_argument("--config", default="paper", help=f"shapes: {sorted(gpu.CONFIGS)} (C, cells, batch)")
    p.add_argument("--formulations", default="grouped,fused/grouped-cells",
                   help=f"step part: comma list from {tuple(gpu.FORMULATIONS)}, each optionally @highest/@bf16")
    p.add_argument("--steps", type=int, default=2, help="MiLeNAS steps per program (per client in a round)")
    p.add_argument("--round-clients", type=int, default=16, help="clients of the round part")
    p.add_argument("--chunks", default="1,4,8,16", help="round part: clients in flight (1: one at a time)")
    p.add_argument("--round-formulation", default="fused/grouped-cells", help="round part's formulation")
    p.add_argument("--scopes", type=int, default=0, help="print the N source scopes with the most launches")
    p.add_argument("--target", default=None, help="XLA GpuTargetConfig text (default: the H100 shipped)")
    p.add_argument("--json", default=None, help="also write the rows as JSON lines here")
    p.add_argument("--seed", type=int, default=0)
    bu.add_output_args(p, "C=4, 1 cell of 1 node, batch 8; 2 clients in chunks of 1 and 2")
    args = p.parse_args(argv)
    if args.quick:
        args.config, args.steps, args.round_clients, args.chunks = "q", 1, 2, "1,2"
    bu.check_choices(p, args.parts, PARTS, "--parts")
    # gpu.py's builders read these fields of its own arguments
    args.best, args.compile_jobs = args.round_formulation, 1
    return args


def abstract(tree, sharding):
    """Every array leaf of ``tree`` as a ``ShapeDtypeStruct`` on ``sharding`` (the GPU)."""
    import jax

    def leaf(a):
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
        return a
    return jax.tree.map(leaf, tree)


def measure(lowered_fn, client_steps: int, scope_depth: int | None) -> dict:
    """Compile, count, and size one program."""
    from jaxfednas.kernels import count_kernels

    t0 = time.perf_counter()
    compiled = lowered_fn().compile()
    compile_s = time.perf_counter() - t0
    count = count_kernels(compiled.as_text(), scope_depth=scope_depth)
    mem = compiled.memory_analysis()
    gib = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                    + mem.temp_size_in_bytes - mem.alias_size_in_bytes) / 2 ** 30
    return {"client_steps": client_steps, "compile_s": compile_s, "xla_gib": gib,
            "per_client_step": count.scaled(client_steps), "total": count.as_dict(),
            "conditionals": count.conditionals, "top_scopes": count.scopes.most_common(40)}


def step_rows(args, sharding):
    import jax

    key = jax.random.PRNGKey(args.seed)
    info, _, one_step, val, variables = gpu.step_inputs(args, key)
    for name in args.formulations.split(","):
        cfg, _, local, precision = gpu.build_step(args, name, info)
        start = gpu.variant_start(cfg, variables)
        inputs = abstract((start, one_step, val, key), sharding)

        def lowered(local=local, inputs=inputs, precision=precision):
            with gpu.matmul_precision(precision):
                return local.lower(*inputs)
        yield {"part": "step", "variant": name, **measure(lowered, args.steps, args.scopes or None)}


def round_rows(args, sharding):
    from jaxfednas.plan import plan_data

    for chunk in [int(c) for c in args.chunks.split(",") if int(c) <= args.round_clients]:
        cfg, n_train, placement = gpu.round_setup(args, chunk)
        data = plan_data(cfg, num_train=n_train, num_test=args.round_clients)
        steps = int(sum(-(-int(n) // cfg.algo.batch_size) for n in data.train.counts))

        def lowered(cfg=cfg, data=data):
            from jaxfednas.registry import build_algorithm
            from jaxfednas.rng import init_key, round_key

            algo = build_algorithm(cfg, data.info)
            state = algo.init(init_key(args.seed))
            return algo.round.lower(*abstract((state, data, round_key(args.seed, 0)), sharding))
        yield {"part": "round", "variant": f"{args.round_formulation}, {chunk} in flight ({placement})",
               "chunk": chunk, **measure(lowered, steps, args.scopes or None)}


def table(rows: list[dict]) -> str:
    head = ("| part | variant | kernels / client-step | fusions | cuDNN convolutions (fwd / bw-input / bw-filter) "
            "| GEMMs | copies | loop iterations | conditionals | XLA memory (GiB) | compile (s) |")
    lines = [head, "|---" * 11 + "|"]
    for r in rows:
        k = r["per_client_step"]
        conv = k["convolutions"]
        convs = " / ".join(f"{conv.get(c, 0):,.0f}" for c in ("convForward", "convBackwardInput", "convBackwardFilter"))
        extra = sum(v for c, v in conv.items() if c not in ("convForward", "convBackwardInput", "convBackwardFilter"))
        convs += f" (+{extra:,.0f} other)" if extra else ""
        gib = "?" if r["xla_gib"] is None else f"{r['xla_gib']:.1f}"
        lines.append(f"| {r['part']} | {r['variant']} | **{k['kernels']:,.0f}** | {k['fusions']:,.0f} | {convs} | "
                     f"{k['gemms']:,.0f} | {k['copies']:,.0f} | {k['loop_iterations']:,.0f} | {r['conditionals']} | "
                     f"{gib} | {r['compile_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from jaxfednas.kernels import H100_TARGET, gpu_target_sharding
    from jaxfednas.nn import compile_for

    try:
        sharding = gpu_target_sharding(args.target or H100_TARGET)
    except (RuntimeError, OSError) as e:
        print(f"kernels.py: {e}", file=sys.stderr)
        return 2
    rows = []
    with compile_for("gpu"):
        for part in args.parts.split(","):
            for row in (step_rows if part == "step" else round_rows)(args, sharding):
                rows.append(row)
                k = row["per_client_step"]
                print(f"{row['part']:5s} {row['variant']}: {k['kernels']:,.0f} kernels per client-step "
                      f"({row['client_steps']} client-steps, compiled in {row['compile_s']:.0f} s)", flush=True)
                if args.scopes:
                    for scope, n in row["top_scopes"][:args.scopes]:
                        print(f"    {n / row['client_steps']:9,.1f}  {scope}")
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    C, layers, batch = gpu.CONFIGS[args.config]
    body = (f"Deviceless compilation for an H100 (jax {jax.__version__}), C={C}, {layers} cells, batch {batch}, "
            f"{args.steps} MiLeNAS step(s) per client; counts per client-step (a proxy for a GPU's time, "
            "not a time).\n\n"
            + table(rows) + "\n")
    bu.publish("GPU kernels per client-step (deviceless count for an H100)", "benchmarks/kernels.py", body,
               path=bu.results_path(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
