"""The virtual-time cluster: callbacks, submissions and aborts in time order; closed-form decode
runs give exactly the results of stepping one step at a time."""

from __future__ import annotations

import random

import pytest

from tidal.replicas.sim.virtual import SimRequest, SimResult, VirtualCluster


def test_a_request_runs_and_reports_its_timings() -> None:
    # Given one replica and a request arriving at t=1 s
    cluster = VirtualCluster("llama-3.1-8b-h100", 1, num_gpu_blocks=500, max_model_len=4096)
    done: list[SimResult] = []
    firsts: list[float] = []
    cluster.at(
        1.0,
        lambda c: c.submit(
            0,
            SimRequest(
                "r",
                100,
                prompt_token_ids=list(range(300)),
                on_first_token=firsts.append,
                on_finish=done.append,
            ),
        ),
    )
    # When the cluster runs
    cluster.run()
    # Then the request finished with its 100 tokens, after its first token
    (res,) = done
    assert res.finish_reason == "length" and res.num_output_tokens == 100 and res.num_prompt_tokens == 300
    assert firsts == [res.first_token_time]
    assert res.ttft is not None and 0 < res.ttft < 0.1
    assert res.tpot is not None and 0.005 < res.tpot < 0.02  # ~7-8 ms per step on one H100
    assert res.e2e == pytest.approx(res.ttft + 99 * res.tpot)
    assert cluster.now == res.finish_time and cluster.pending() == 0


def test_callbacks_see_the_replicas_at_their_own_time() -> None:
    cluster = VirtualCluster("llama-3.1-8b-h100", 2, num_gpu_blocks=500, max_model_len=4096)
    seen: list[tuple[float, float, float]] = []
    cluster.at(0.0, lambda c: c.submit(1, SimRequest("long", 2000, prompt_token_ids=[1] * 100)))
    for t in (0.5, 1.0, 1.5):
        cluster.at(
            t,
            lambda c: seen.append(
                (c.now, c.engines[1].snapshot().generation_tokens, c.engines[0].snapshot().num_running)
            ),
        )
    cluster.run(until=2.0)
    assert [s[0] for s in seen] == [0.5, 1.0, 1.5]
    # Tokens keep coming at the decode rate while replica 0 stays idle.
    assert 0 < seen[0][1] < seen[1][1] < seen[2][1] and all(s[2] == 0 for s in seen)
    rate = (seen[2][1] - seen[0][1]) / 1.0
    assert 100 < rate < 200  # one sequence on one H100: ~130 tokens/s
    assert cluster.now == 2.0


def test_abort_reports_reason_abort_and_frees_the_replica() -> None:
    cluster = VirtualCluster("llama-3.1-8b-h100", 1, num_gpu_blocks=500, max_model_len=4096)
    done: list[SimResult] = []
    cluster.at(
        0.0, lambda c: c.submit(0, SimRequest("r", 5000, prompt_token_ids=[1] * 100, on_finish=done.append))
    )
    cluster.at(1.0, lambda c: c.abort(0, "r"))
    cluster.run()
    (res,) = done
    assert res.finish_reason == "abort" and res.finish_time == 1.0 and 0 < res.num_output_tokens < 5000
    assert cluster.engines[0].snapshot().kv_cache_usage == 0


def test_trace_requests_by_block_hashes() -> None:
    cluster = VirtualCluster("llama-3.1-8b-h100", 1, num_gpu_blocks=500, max_model_len=4096)
    done: list[SimResult] = []
    shared = list(range(40))  # 40 blocks = 640 tokens shared
    for i in range(3):
        own = [1000 * (i + 1) + j for j in range(10)]
        req = SimRequest(
            f"t{i}", 10, block_hashes=shared + own, num_prompt_tokens=16 * 50 + 5, on_finish=done.append
        )
        cluster.at(float(i), lambda c, req=req: c.submit(0, req))
    cluster.run()
    assert [r.num_cached_tokens for r in sorted(done, key=lambda r: r.request_id)] == [0, 640, 640]


def _workload(cluster: VirtualCluster, seed: int, results: list[SimResult]) -> None:
    rng = random.Random(seed)
    t = 0.0
    n_rep = len(cluster.engines)
    for e in cluster.engines:
        e.load_lora("a", "/a")
        e.load_lora("b", "/b")
    for i in range(150):
        t += rng.expovariate(6.0)
        n = rng.randint(20, 1200)
        sys_prompt = [rng.randint(0, 2)] * min(n, 256)
        tokens = sys_prompt + [rng.randint(0, 10**6) for _ in range(n - len(sys_prompt))]
        lora = rng.choice([None, None, "a", "b"])
        req = SimRequest(
            f"r{i}",
            rng.randint(1, 300),
            prompt_token_ids=tokens,
            priority=rng.randint(0, 2),
            lora=lora,
            stop_after=rng.choice([None, rng.randint(1, 200)]),
            on_finish=results.append,
        )
        rep = i % n_rep
        cluster.at(t, lambda c, req=req, rep=rep: c.submit(rep, req))
        if rng.random() < 0.1:
            cluster.at(t + rng.uniform(0, 2), lambda c, rid=req.request_id, rep=rep: c.abort(rep, rid))
        if rng.random() < 0.2:
            cluster.at(t, lambda c: [e.snapshot() for e in c.engines])  # a scrape


@pytest.mark.parametrize("seed", [0, 1])
def test_closed_form_runs_give_the_results_of_stepping(seed: int) -> None:
    def run(ff: bool) -> tuple[list[tuple[object, ...]], list[object]]:
        cluster = VirtualCluster(
            "llama-3.1-8b-h100",
            2,
            fast_forward=ff,
            num_gpu_blocks=140,  # tight: preemptions happen
            max_num_seqs=12,
            max_model_len=2048,
            max_loras=1,
            check_invariants=not ff,
        )
        results: list[SimResult] = []
        _workload(cluster, seed, results)
        cluster.run()
        rows = sorted(
            (
                r.request_id,
                r.replica,
                r.finish_reason,
                r.num_output_tokens,
                r.num_cached_tokens,
                r.num_preemptions,
                round(r.finish_time, 7),
                round(r.first_token_time or -1, 7),
            )
            for r in results
        )
        snaps = [e.snapshot() for e in cluster.engines]
        return rows, [
            (s.prefix_cache_hits, s.num_preemptions, s.generation_tokens, s.requests_finished) for s in snaps
        ]

    stepped, s_snaps = run(False)
    fast, f_snaps = run(True)
    assert len(stepped) == 150
    assert fast == stepped and f_snaps == s_snaps
    assert sum(s[1] for s in s_snaps) > 0, "the workload should exercise preemption"
