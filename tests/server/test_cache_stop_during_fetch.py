"""A server that stops does not wait for the fetches in flight: a direct download ends at its
next chunk and removes its temporary folder, a POST to the node agent (up to 10 minutes) is
left to end with the process. The staging threads were a ThreadPoolExecutor's, which the
cache's close and the interpreter's exit both waited for."""

from __future__ import annotations

import http.server
import threading
import time

from loraplex.server.adapter_sources import FetchThreads

from .test_adapter_cache import _Files, make_cache, write_adapter


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_close_does_not_wait_for_the_node_agent(tmp_path_factory):
    bucket, cache_dir = tmp_path_factory.mktemp("bucket"), tmp_path_factory.mktemp("cache")
    write_adapter(bucket / "slow", seed=1)
    with _Files(bucket, cache_dir, delay=30) as agent:
        cache = make_cache(cache_dir, slots=2, node_agent_url=agent.url)
        cache.register("slow", source="s3://bucket/slow")
        cache.prefetch("slow")
        _wait(lambda: agent.staged)  # the POST is in flight; the agent answers in 30 s
        t0 = time.monotonic()
        cache.close()
        assert time.monotonic() - t0 < 5


class _Drip(threading.Thread):
    """Serves a config, then a weights file announced as 64 MB that comes 4 KB every 50 ms."""

    def __init__(self, config: bytes):
        outer = self
        self.sent = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path.endswith("adapter_config.json"):
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(config)))
                    self.end_headers()
                    self.wfile.write(config)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(64 << 20))
                self.end_headers()
                try:
                    while True:
                        self.wfile.write(b"\0" * 4096)
                        self.wfile.flush()
                        outer.sent += 4096
                        time.sleep(0.05)
                except OSError:
                    pass

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        super().__init__(target=self.server.serve_forever, daemon=True)


def test_close_ends_a_direct_download_and_removes_its_folder(tmp_path_factory):
    src, cache_dir = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("cache")
    write_adapter(src / "a", seed=2)
    drip = _Drip((src / "a" / "adapter_config.json").read_bytes())
    drip.start()
    try:
        cache = make_cache(cache_dir, slots=2)
        cache.register("big", source=f"{drip.url}/big")
        fut = cache.prefetch("big")
        _wait(lambda: drip.sent > 8192 and any(p.name.startswith(".big.") for p in cache_dir.iterdir()))
        t0 = time.monotonic()
        cache.close()
        assert time.monotonic() - t0 < 3
        assert not any(p.name.startswith(".big.") for p in cache_dir.iterdir())  # the part downloaded is gone
        assert not (cache_dir / "big").exists()
        assert "stopped during the download" in str(fut.exception(5))
    finally:
        drip.server.shutdown()


def test_fetch_threads_run_jobs_on_at_most_n_threads_and_stop_without_waiting():
    pool = FetchThreads(2, "test-fetch")
    release, ran, names = threading.Event(), [], set()

    def job(i):
        names.add(threading.current_thread().name)
        ran.append(i)

    for i in range(6):
        pool.submit(job, i)
    _wait(lambda: len(ran) == 6)
    assert sorted(ran) == list(range(6)) and len(names) <= 2
    for _ in range(2):
        pool.submit(release.wait)  # both threads busy for good
    _wait(lambda: pool._unfinished == 2)
    pool.submit(job, 99)  # queued behind them
    t0 = time.monotonic()
    pool.stop(grace=0.2)
    assert time.monotonic() - t0 < 1
    release.set()
    time.sleep(0.1)
    assert 99 not in ran  # a job not started when the pool stopped never starts
    pool.submit(job, 100)
    time.sleep(0.05)
    assert 100 not in ran
