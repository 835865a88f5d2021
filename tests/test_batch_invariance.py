"""A request's tokens and logprobs on the `cpu` backend do not depend on what runs beside it
(with quantized weights, under --batch-invariant): the conformance suite's invariance tier,
every row, bit for bit — a reference engine, and a busy
engine started separately for each row with options of its own — and the tier catches a backend whose reduction order
depends on the batch size while it declares invariance, and shows (without failing) one that
says it is not invariant."""

from __future__ import annotations

from pagedllm.backends.registry import load_backend
from pagedllm.conformance.invariance_checks import CASES, VARIANTS, check_invariance
from pagedllm.conformance.results import format_table
from pagedllm.conformance.suite import tiny_model_dir


def test_the_cpu_backend_gives_a_request_the_same_bits_in_every_invariance_row():
    rows = check_invariance("cpu", load_backend("cpu"), tiny_model_dir, quick=False)
    quantized = sum("quantization" in options for _, _, options in VARIANTS)
    assert len(rows) == len(CASES) + len(VARIANTS) + quantized  # every row ran
    held = [r for r in rows if not r.informational]
    assert all(r.ok and r.cases == r.passed for r in held), format_table("cpu", rows)
    # quantized layers are invariant with --batch-invariant only: without it a small step takes
    # another kernel than a large one, and the rows are information (the prefill chunks show it)
    shown = {r.check: r for r in rows if r.informational}
    assert set(shown) == {"invariance batch, int8 weights", "invariance chunked_prefill, int8 weights"}
    assert shown["invariance chunked_prefill, int8 weights"].passed == 0


def test_a_batch_size_dependent_backend_is_caught_and_an_honest_one_is_shown(plugins_installed):
    caught = check_invariance(
        "batch-size-dependent",
        load_backend("batch-size-dependent"),
        tiny_model_dir,
        False,
        cases=("batch", "one_thread"),
        variants=False,
    )
    # caught where the batch changes, and only there
    assert [r.check for r in caught if not r.ok] == ["invariance batch"], format_table("planted", caught)
    assert "logprobs differ" in caught[0].failures[0] or "tokens part" in caught[0].failures[0]
    honest = load_backend("batch-size-dependent-undeclared")
    shown = check_invariance(honest.name, honest, tiny_model_dir, False, cases=("batch",), variants=False)
    assert shown[0].ok and shown[0].informational and shown[0].passed == 0 and shown[0].worst_error > 0
    assert " info " in format_table(honest.name, shown)


def test_under_tensor_parallelism_the_bits_hold_within_a_size():
    """Two ranks split each row-parallel product's reduction and sum the halves: the order is
    fixed by the size, not by the batch, so the rows hold at 2 ranks as at 1 (across sizes the
    logprobs may differ in their last bits; docs/tensor-parallel.md)."""
    rows = check_invariance(
        "cpu",
        load_backend("cpu"),
        tiny_model_dir,
        False,
        cases=("batch",),
        variants=False,
        tensor_parallel_size=2,
    )
    assert all(r.ok and r.cases == r.passed for r in rows), format_table("cpu, 2 ranks", rows)
