"""Two `slotstream serve` replicas behind LiteLLM's proxy (PyPI `litellm[proxy]`):
its health checks see both, it balances requests over both, and when one
replica drains (SIGTERM) or dies (SIGKILL) in the middle of a run, every
request still gets its answer, the proxy retrying on the other replica what the
lost one did not finish. Non-streamed requests only: a stream already under way
cannot be retried by any proxy.

Started by run.sh with SLOTSTREAM_BIN (the server), SLOTSTREAM_FIXTURE_DIR (the
model both replicas serve as SLOTSTREAM_MODEL), LITELLM_BIN (the proxy, from its
own virtual environment) and SLOTSTREAM_SCRATCH (a folder for logs and the
proxy's config). Every wait is bounded."""

import concurrent.futures
import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

BIN = os.environ.get("SLOTSTREAM_BIN", "")
FIXTURE = os.environ.get("SLOTSTREAM_FIXTURE_DIR", "")
MODEL = os.environ.get("SLOTSTREAM_MODEL", "qwen3_moe_mlx4")
LITELLM = os.environ.get("LITELLM_BIN", "")
SCRATCH = os.environ.get("SLOTSTREAM_SCRATCH", "")
ROUTED = "slotstream"
# A burst larger than a replica runs at once, so that each has requests
# running and waiting when one of them goes.
BURST = 8
pytestmark = pytest.mark.skipif(not (BIN and FIXTURE and LITELLM and SCRATCH), reason="run by run.sh")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, headers=None, timeout=10):
    """(status, body) of a GET, an HTTP error's status included."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_for(what, check, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {seconds} s")


class Replica:
    """One `serve` of the fixture on a port of its own."""

    def __init__(self, index):
        self.index = index
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None
        self.start()

    def start(self):
        log = open(os.path.join(SCRATCH, f"replica{self.index}.log"), "ab")
        env = dict(os.environ, HF_HUB_CACHE=os.path.join(SCRATCH, f"hub{self.index}"), HF_TOKEN="")
        self.process = subprocess.Popen(
            [BIN, "serve", "--model", FIXTURE, "--name", MODEL, "--port", str(self.port), "--queue", "16",
             "--shutdown-grace-secs", "60"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_for(f"replica {self.index} ready", lambda: get(self.url + "/health/ready")[0] == 200, 60)

    def running(self):
        """The replica's slotstream:num_requests_running, from /metrics."""
        status, text = get(self.url + "/metrics")
        assert status == 200
        for family in text_string_to_metric_families(text):
            if family.name == "slotstream:num_requests_running":
                return sum(s.value for s in family.samples)
        return 0  # none until the model has been asked for

    def finished(self):
        """Requests the replica finished (slotstream:e2e_request_latency_seconds' count)."""
        status, text = get(self.url + "/metrics")
        assert status == 200
        for family in text_string_to_metric_families(text):
            if family.name == "slotstream:e2e_request_latency_seconds":
                return sum(s.value for s in family.samples if s.name.endswith("_count"))
        return 0

    def stop(self, sig):
        self.process.send_signal(sig)
        return self.process.wait(timeout=90)


@pytest.fixture(scope="module")
def cluster():
    replicas = [Replica(0), Replica(1)]
    key = "sk-" + secrets.token_hex(16)
    port = free_port()
    # One model name over both replicas, through LiteLLM's OpenAI provider;
    # a failed call is retried at once, and a replica that fails is left out
    # for 5 s.
    config = {
        "model_list": [
            {"model_name": ROUTED,
             "litellm_params": {"model": f"openai/{MODEL}", "api_base": r.url + "/v1", "api_key": "unused", "timeout": 120}}
            for r in replicas
        ],
        "router_settings": {"routing_strategy": "simple-shuffle", "num_retries": 6, "retry_after": 0,
                            "allowed_fails": 1, "cooldown_time": 5},
        "litellm_settings": {"telemetry": False, "request_timeout": 120},
    }
    path = os.path.join(SCRATCH, "litellm.json")  # YAML reads JSON
    with open(path, "w") as f:
        json.dump(config, f)
    log = open(os.path.join(SCRATCH, "litellm.log"), "ab")
    env = dict(os.environ, LITELLM_MASTER_KEY=key, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
    proxy = subprocess.Popen([LITELLM, "--config", path, "--host", "127.0.0.1", "--port", str(port)],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the LiteLLM proxy", lambda: proxy.poll() is None and get(url + "/health/liveliness")[0] == 200, 120)
        yield {"replicas": replicas, "url": url, "key": key}
    finally:
        for process in [proxy] + [r.process for r in replicas]:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


def client(cluster):
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key=cluster["key"], max_retries=0, timeout=180)


def health(cluster):
    """LiteLLM's /health: it calls each replica's model now."""
    status, body = get(cluster["url"] + "/health", {"Authorization": "Bearer " + cluster["key"]}, timeout=120)
    assert status == 200, body
    report = json.loads(body)
    bases = lambda key: sorted(e["api_base"] for e in report[key])
    return bases("healthy_endpoints"), bases("unhealthy_endpoints")


def ask(cluster, i, max_tokens):
    r = client(cluster).chat.completions.create(
        model=ROUTED, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=max_tokens, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content is not None
    return r


def burst_while(cluster, victim, sig):
    """BURST clients at once, each asking again as soon as it is answered,
    until `victim` is running one of their requests; then it gets `sig`, and
    each client stops after the request it has under way. A fixed burst raced
    the poll on a fast machine: every request could be answered between two
    looks at /metrics. Returns the answers (raising if any request failed) and
    the victim's exit status."""
    signalled = threading.Event()

    def keep_asking(worker):
        answers = []
        while True:
            answers.append(ask(cluster, worker, 48))
            if signalled.is_set():
                return answers

    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        clients = [pool.submit(keep_asking, i) for i in range(BURST)]
        try:
            wait_for("a request running on the replica to be stopped", lambda: victim.running() >= 1, 60)
            code = victim.stop(sig)
        finally:
            signalled.set()
        return [a for c in clients for a in c.result(timeout=300)], code


def test_health_checks_see_both_replicas(cluster):
    healthy, unhealthy = health(cluster)
    assert healthy == sorted(r.url + "/v1" for r in cluster["replicas"]) and unhealthy == []


def test_requests_are_balanced_over_both_replicas(cluster):
    before = [r.finished() for r in cluster["replicas"]]
    for i in range(16):
        ask(cluster, i, 2)
    served = [r.finished() - b for r, b in zip(cluster["replicas"], before)]
    assert sum(served) >= 16 and min(served) >= 1, served


def test_a_draining_replica_finishes_its_requests_and_the_proxy_retries_the_rest(cluster):
    drained = cluster["replicas"][0]
    answers, code = burst_while(cluster, drained, signal.SIGTERM)
    assert len(answers) >= BURST
    assert code == 0, "a drain that finished its requests exits 0"
    # Back for the next case: healthy, and given requests again once the
    # proxy's cooldown of it has passed.
    drained.start()
    wait_for("the proxy to see the restarted replica healthy",
             lambda: drained.url + "/v1" in health(cluster)[0], 60)
    served = drained.finished()
    wait_for("the proxy to route to the restarted replica", lambda: ask(cluster, 1, 2) and drained.finished() > served, 60)


def test_a_killed_replica_loses_no_request_the_proxy_retries(cluster):
    killed, survivor = cluster["replicas"]
    answers, code = burst_while(cluster, killed, signal.SIGKILL)
    assert len(answers) >= BURST and code == -signal.SIGKILL
    healthy, unhealthy = health(cluster)
    assert healthy == [survivor.url + "/v1"] and unhealthy == [killed.url + "/v1"]
    # The proxy keeps answering from the survivor.
    for i in range(4):
        ask(cluster, i, 2)
