"""`minivllm serve`'s live page, /dashboard: its snapshots against /metrics under load, its
event stream, its API key, and the page itself in headless Chromium (tests/browser.py).
(--disable-dashboard: tests/test_server.py's test_tokenizer_info.)"""

from __future__ import annotations

import base64
import json
import signal
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from minivllm.engine.kv_cache_manager import BLOCK_CACHED, BLOCK_FREE, BLOCK_IN_USE
from minivllm.entrypoints.openai.dashboard import MAX_MAP_CELLS, _block_map, _latency
from tests import browser
from tests.server_utils import Load, RemoteServer, serving

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NUM_SEQS = 4
# 40 blocks of 8 tokens (the tiny model's K and V take 512 bytes a token in float32): fewer than
# MAX_NUM_SEQS requests of up to ~95 tokens can hold, so requests wait and some are preempted.
SERVER_ARGS = ("--max-num-seqs", str(MAX_NUM_SEQS), "--block-size", "8", "--max-model-len", "128",
               "--kv-cache-memory-bytes", str(40 * 8 * 512))
# Counters the page and /metrics both show: (snapshot path, /metrics name).
COUNTERS = [(("tokens", "prompt"), "vllm:prompt_tokens_total"),
            (("tokens", "generation"), "vllm:generation_tokens_total"),
            (("prefix_cache", "queries"), "vllm:prefix_cache_queries_total"),
            (("prefix_cache", "hits"), "vllm:prefix_cache_hits_total"),
            (("num_preemptions",), "vllm:num_preemptions_total")]


def test_a_big_cache_is_drawn_a_few_blocks_a_cell() -> None:
    states = np.full(70_001, BLOCK_FREE, np.uint8)  # 3 blocks a cell; the last cell holds 2
    states[:30_000] = BLOCK_IN_USE
    states[30_000:60_000:3] = BLOCK_CACHED  # one of each cell's 3: the cells stay free
    states[60_000:60_003] = [BLOCK_CACHED, BLOCK_CACHED, BLOCK_IN_USE]
    states[-1] = BLOCK_CACHED
    cells, blocks_per_cell = _block_map(states)
    assert blocks_per_cell == 3 and len(cells) == 23_334 <= MAX_MAP_CELLS
    assert set(cells[:10_000]) == {BLOCK_IN_USE} and set(cells[10_000:20_000]) == {BLOCK_FREE}
    assert cells[20_000] == BLOCK_CACHED and cells[-1] == BLOCK_FREE  # a tie (1 free, 1 cached): the first state
    assert _block_map(states[:1000]) == (states[:1000].tobytes(), 1)


def test_latency_percentiles_of_the_last_minutes() -> None:
    now = 10_000.0
    recent = deque([(now - 400, 9.0)]  # too old: left out
                   + [(now - 295 + i / 100, 0.001 * i) for i in range(100)]  # the first bucket
                   + [(now - 5, 2.0), (now - 1, 4.0)])  # the last
    latency = _latency(recent, now)
    assert latency["count"] == 102
    (start, *first, count), (last_start, *last, last_count) = latency["buckets"]
    assert (start, count, last_start, last_count) == (now - 300, 100, now - 10, 2)
    assert first == pytest.approx([0.0495, 0.0891, 0.09801]) and last == pytest.approx([3.0, 3.8, 3.98])
    assert _latency(deque(), now) == {"count": 0, "all": None, "buckets": []}


@pytest.fixture(scope="module")
def server(tiny_model_factory) -> Iterator[RemoteServer]:
    with serving(tiny_model_factory("Qwen3ForCausalLM"), *SERVER_ARGS, api_key=KEY,
                 stop_signal=signal.SIGINT) as server:
        yield server


def snapshot(server: RemoteServer) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/dashboard/snapshot", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def field(replica: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        replica = replica[key]
    return replica


def test_snapshot_under_load(server: RemoteServer) -> None:
    with Load(server.url, concurrency=3 * MAX_NUM_SEQS, api_key=KEY):
        time.sleep(1.5)  # requests running and waiting, latencies recorded
        before = server.metrics()
        first = snapshot(server)
        after = server.metrics()
        time.sleep(1.1)
        second = snapshot(server)  # one snapshot a second at most: this one is new
    assert second["time"] - first["time"] >= 1.0
    (replica,) = first["replicas"]
    assert replica["engine"] == 0 and replica["up"]
    for path, name in COUNTERS:  # the counters grow: the snapshot's lie between the two scrapes
        assert before[name] <= field(replica, path) <= after[name], name
    assert replica["tokens"]["generation"] > 0

    kv = replica["kv_cache"]
    states = base64.b64decode(kv["map"])
    assert kv["blocks_per_cell"] == 1 and len(states) == kv["num_blocks"] == 40
    assert [states.count(state) for state in range(3)] == [kv["free"], kv["in_use"], kv["cached"]]
    assert kv["free"] + kv["in_use"] + kv["cached"] == kv["num_blocks"] and kv["in_use"] > 0
    assert kv["usage"] == pytest.approx(kv["in_use"] / kv["num_blocks"])  # cached blocks count as free

    # The engine's counts and its request list come from one moment of the engine core.
    listed = replica["requests"]["listed"]
    states_listed = [request["state"] for request in listed]
    assert len(listed) == replica["requests"]["total"] == replica["num_running"] + replica["num_waiting"] > 0
    assert 0 < states_listed.count("running") == replica["num_running"] <= MAX_NUM_SEQS
    assert states_listed.count("preempted") == replica["num_preempted"]
    assert states_listed.count("waiting") + replica["num_preempted"] == replica["num_waiting"] > 0
    for request in listed:
        assert request["id"].startswith("cmpl-") and request["prompt_tokens"] > 0 and request["age_s"] >= 0
        assert request["output_tokens"] >= (1 if request["state"] == "running" else 0)

    (replica,) = second["replicas"]  # rates: over the snapshots of the last seconds
    assert replica["tokens"]["prompt_per_s"] > 0 and replica["tokens"]["generation_per_s"] > 0
    assert 0 <= replica["prefix_cache"]["recent_hit_rate"] <= 1
    for name in ("ttft", "tpot"):
        latency = replica["latency"][name]
        assert latency["count"] > 0 and 0 < latency["all"][0] <= latency["all"][1] <= latency["all"][2]
        assert sum(bucket[-1] for bucket in latency["buckets"]) == latency["count"]
        for start, p50, p90, p99, _ in latency["buckets"]:
            assert second["time"] - 300 <= start <= second["time"] and p50 <= p90 <= p99


def test_events_come_once_a_second(server: RemoteServer) -> None:
    times = []
    with httpx.stream("GET", f"{server.url}/dashboard/events", headers=AUTH, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                times.append(json.loads(line.removeprefix("data: "))["time"])
                if len(times) == 3:
                    break
    assert 0.9 <= times[1] - times[0] <= 2 and 0.9 <= times[2] - times[1] <= 2


def test_the_key_guards_the_page_and_its_data(server: RemoteServer) -> None:
    page = httpx.get(f"{server.url}/dashboard")
    assert page.status_code == 401 and 'id="key-form"' in page.text  # the page that asks for the key
    for path in ("/dashboard/events", "/dashboard/snapshot"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.get(server.url + path, headers=headers)
            assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
    for given in ({"params": {"key": KEY}}, {"cookies": {"minivllm_api_key": KEY}}, {"headers": AUTH}):
        response = httpx.get(f"{server.url}/dashboard", **given)  # type: ignore[arg-type]
        assert response.status_code == 200 and 'id="replica-template"' in response.text
        assert httpx.get(f"{server.url}/dashboard/snapshot", **given).status_code == 200  # type: ignore[arg-type]


PAGE_NUMBERS = """
const values = {};
for (const element of document.querySelectorAll("#engine-0 [data-field]")) {
  values[element.dataset.field] = element.dataset.value;
}
const canvas = document.querySelector("#engine-0 canvas.kv-map");
const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
const colors = {};
for (let i = 0; i < pixels.length; i += 4) {
  const color = `${pixels[i]},${pixels[i + 1]},${pixels[i + 2]},${pixels[i + 3]}`;
  colors[color] = (colors[color] || 0) + 1;
}
return {values, colors, rows: document.querySelectorAll("#engine-0 tbody tr").length,
        updates: Number(document.body.dataset.updates)};
"""
COLORS = {"kv_free": "228,228,228,255", "kv_in_use": "44,123,229,255", "kv_cached": "108,192,112,255"}


@pytest.mark.slow
def test_the_page_in_a_browser(server: RemoteServer) -> None:
    """Chromium renders the numbers of the event stream: each between /metrics before and
    after, the block map's cells in the cache's counts, the requests as table rows."""
    if reason := browser.missing():
        pytest.skip(reason)
    with Load(server.url, concurrency=3 * MAX_NUM_SEQS, api_key=KEY), browser.Chromium() as chromium:
        # The key typed into the page that asks for it, kept in a cookie the event stream sends.
        chromium.open(f"{server.url}/dashboard")
        chromium.run(f"document.getElementById('key').value = '{KEY}'; "
                     "document.getElementById('key-form').requestSubmit();")
        chromium.wait_for("return Number(document.body.dataset.updates) >= 1")
        chromium.run("document.cookie = 'minivllm_api_key=; max-age=0; path=/dashboard';")
        # The key in the address: moved into the cookie, and out of the address.
        chromium.open(f"{server.url}/dashboard?key={KEY}")
        chromium.wait_for("return Number(document.body.dataset.updates) >= 2")
        assert chromium.run("return [location.search, document.cookie]") == ["", f"minivllm_api_key={KEY}"]
        before = server.metrics()
        updates = chromium.run("return Number(document.body.dataset.updates)")
        # The second event after the scrape: built after it (the first may have been on its way).
        chromium.wait_for(f"return Number(document.body.dataset.updates) >= {updates + 2}")
        page = chromium.run(PAGE_NUMBERS)
        after = server.metrics()
    values = {name: float(value) for name, value in page["values"].items() if value not in ("", None)}
    for name, metric in [("prompt_tokens", "vllm:prompt_tokens_total"),
                         ("generation_tokens", "vllm:generation_tokens_total"),
                         ("num_preemptions", "vllm:num_preemptions_total")]:
        assert before[metric] <= values[name] <= after[metric], name
    assert values["generation_tokens"] > 0 and values["generation_per_s"] > 0 and values["prompt_per_s"] > 0
    hits = (before["vllm:prefix_cache_hits_total"], after["vllm:prefix_cache_hits_total"])
    queries = (before["vllm:prefix_cache_queries_total"], after["vllm:prefix_cache_queries_total"])
    assert hits[0] / queries[1] <= values["hit_rate"] <= hits[1] / queries[0]
    assert 0 < values["num_running"] <= MAX_NUM_SEQS and values["num_waiting"] >= 0
    assert values["kv_num_blocks"] == 40 == values["kv_free"] + values["kv_in_use"] + values["kv_cached"]
    assert values["kv_usage"] == pytest.approx(values["kv_in_use"] / 40)
    for name, color in COLORS.items():  # one pixel a block on the canvas (then scaled up)
        assert page["colors"].get(color, 0) == values[name], name
    assert page["rows"] == values["requests_total"] == values["num_running"] + values["num_waiting"]
    for name in ("ttft", "tpot"):
        assert 0 < values[f"{name}_p50"] <= values[f"{name}_p90"] <= values[f"{name}_p99"]
