"""benchmarks/throughput.py on CPU at --scale 0.02 (W1's draw, shrunk): --repeats reports every
run's tok/s and their median, and resets the prefix cache between runs, so that no run finds
the last run's prompts cached (W1's prompts would otherwise hit from the second run on;
here 8-token blocks, so that the shrunk prompts fill some)."""

import json
import sys

from benchmarks import throughput


def test_repeats_report_the_median_of_uncached_runs(tiny_model_factory, tmp_path, monkeypatch) -> None:
    model = tiny_model_factory("Qwen3ForCausalLM")
    out = tmp_path / "w1.jsonl"
    monkeypatch.setattr(sys, "argv", ["throughput", "--model", model, "--scale", "0.02", "--repeats", "3",
                                      "--block-size", "8", "--json-out", str(out)])
    hits = []
    timed_generate = throughput.timed_generate

    def counting(llm, requests, temperature, schema=None):
        before = llm.llm_engine.stats()["prefix_cache_hits"]
        metrics = timed_generate(llm, requests, temperature, schema)
        hits.append(llm.llm_engine.stats()["prefix_cache_hits"] - before)
        return metrics

    monkeypatch.setattr(throughput, "timed_generate", counting)
    throughput.main()
    result = json.loads(out.read_text())
    runs = result["output_tok_s_runs"]
    assert len(runs) == 3 and result["output_tok_s"] == sorted(runs)[1]
    assert result["output_tokens"] == result["expected_output_tokens"]
    assert hits == [0, 0, 0]
