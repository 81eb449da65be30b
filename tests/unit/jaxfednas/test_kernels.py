"""The kernel counter of deviceless GPU compilation (jaxfednas.kernels), on saved HLO text.

``tests/golden/scan_conv_grad_h100.hlo.txt`` is the optimized HLO that XLA (jax 0.11.2 with
the CUDA 13 plugin, ``JAX_PLATFORMS=cpu``) compiled for an H100 from the gradient of a
3-step ``lax.scan`` of ``tanh(conv3x3(x))``: its launches were counted by hand from the
text (see each assertion)."""
from pathlib import Path

import pytest

from jaxfednas.kernels import count_kernels, scope_of
from jaxfednas.nn import compile_for, default_depthwise_impl, target_platform, use_fast_grad

GOLDEN = Path(__file__).parents[2] / "golden" / "scan_conv_grad_h100.hlo.txt"


def test_counts_a_deviceless_gpu_program_by_hand():
    c = count_kernels(GOLDEN.read_text())
    # forward loop: 3 iterations x (conv, tanh, dynamic-update-slice, counter) + 4 condition
    # evaluations; backward loop: 3 x (multiply, counter, conv backward-input) + 4 conditions;
    # outside: the kernel's transpose, the zero-filled stack, the output's multiply, 3 copies
    assert c.custom_calls == {"__cudnn$convForward": 3, "__cudnn$convBackwardInput": 3}
    assert c.convolutions == {"convForward": 3, "convBackwardInput": 3}
    assert c.fusions == 3 * 3 + 4 + 3 * 2 + 4 + 3 == 26
    assert c.copies == 3
    assert c.kernels == 26 + 6 + 3
    assert c.loop_iterations == 6 and c.unknown_trip_loops == 0 and c.conditionals == 0
    assert c.scaled(2)["kernels"] == pytest.approx(17.5)


def test_scopes_add_up_to_the_launches():
    c = count_kernels(GOLDEN.read_text(), scope_depth=2)
    assert sum(c.scopes.values()) == c.kernels
    assert c.scopes["conv_general_dilated"] == 6 and c.scopes["tanh"] == 3


CONDITIONAL = """
%fa (p: f32[4]) -> f32[4] {
  ROOT %p = f32[4]{0} parameter(0)
}
%then (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %a = f32[4]{0} fusion(%p), kind=kLoop, calls=%fa
  ROOT %b = f32[4]{0} fusion(%a), kind=kInput, calls=%fa
}
%else (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %g = (f32[4]{0}, s8[0]{0}) custom-call(%p, %p), custom_call_target="__cublas$gemm"
}
%called (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %s = f32[4]{0} sort(%p), dimensions={0}, to_apply=%fa
}
ENTRY %main (x: f32[4], c: pred[]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %c = pred[] parameter(1)
  %k = f32[4]{0} call(%x), to_apply=%called
  %w = f32[4]{0} while(%k), condition=%fa, body=%then
  ROOT %r = f32[4]{0} conditional(%c, %w, %w), true_computation=%then, false_computation=%else
}
"""


def test_conditionals_count_every_branch_and_unknown_loops_once():
    c = count_kernels(CONDITIONAL)
    assert c.conditionals == 1
    # the call's sort; the while (no known trip count) once: 2 fusions; both branches: 2 + 1 GEMM
    assert c.others == {"sort": 1}
    assert c.fusions == 4 and c.fusion_kinds == {"kLoop": 2, "kInput": 2}
    assert c.gemms == 1 and c.kernels == 6
    assert c.unknown_trip_loops == 1 and c.loop_iterations == 1


def test_text_that_is_no_hlo_module_is_refused():
    with pytest.raises(ValueError, match="ENTRY"):
        count_kernels("HloModule m\n")


def test_arguments_of_the_wrong_type_are_named():
    """count_kernels(None) / bytes gave AttributeError / a regex TypeError; scope_depth=-1 passed."""
    text = "HloModule m\n\nENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(1)\n}\n"
    for bad in (None, text.encode()):
        with pytest.raises(TypeError, match="count_kernels: hlo_text must be the HLO module's text"):
            count_kernels(bad)
    for depth in (-1, 1.5, True):
        with pytest.raises(ValueError, match="scope_depth must be None or an int >= 0"):
            count_kernels(text, scope_depth=depth)
    assert count_kernels(text, scope_depth=0).kernels == count_kernels(text).kernels


def test_scope_drops_jax_transformations():
    line = '%f = f32[] fusion(), metadata={op_name="jit(step)/transpose(jvp())/while/body/cell_3/edges/sep/conv"}'
    assert scope_of(line, depth=2) == "cell_3/edges/conv"
    assert scope_of("%f = f32[] fusion()") == "?"


def test_compile_for_changes_every_backend_choice_at_trace_time():
    assert target_platform() == "cpu" and use_fast_grad() and default_depthwise_impl() == "fused"
    with compile_for("gpu"):
        assert target_platform() == "gpu" and not use_fast_grad() and default_depthwise_impl() == "grouped"
    assert target_platform() == "cpu"
    with pytest.raises(ValueError, match="platform"):
        with compile_for("cuda"):
            pass


def test_an_asynchronous_pair_counts_once():
    text = """
%fa (p: f32[4]) -> f32[4] {
  ROOT %p = f32[4]{0} parameter(0)
}
ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %s = ((f32[4]{0}), f32[4]{0}) fusion-start(%x), kind=kLoop, calls=%fa
  %d = f32[4]{0} fusion-done(%s)
  %c = (f32[4]{0}, f32[4]{0}, u32[]) copy-start(%d)
  ROOT %e = f32[4]{0} copy-done(%c)
}
"""
    c = count_kernels(text)
    assert c.others == {"fusion-start": 1, "copy-start": 1} and c.kernels == 2
