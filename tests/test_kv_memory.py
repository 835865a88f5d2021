from pagedllm.benchmarks.kv_memory import measure_kv_utilisation


def test_paged_kv_keeps_allocated_slots_live():
    r = measure_kv_utilisation(num_requests=1000)
    assert r["paged"] >= 0.96
    assert r["contiguous_max_model_len"] < 0.5 and r["contiguous_exact_length"] < r["paged"]
