"""The dashboard in a real browser (headless Chromium + Selenium) against a
real ``fencepost serve`` process and real worker processes.

Set FENCEPOST_SCREENSHOT_DIR=docs to refresh the screenshots in docs/."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from _web import WebServer, Worker
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

import fencepost
from fencepost import SyncClient

pytestmark = pytest.mark.slow
T = TypeVar("T")


def wait_for(fn: Callable[[], T], timeout: float = 10.0, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except (StaleElementReferenceException, NoSuchElementException):
            pass  # the page redrew the row meanwhile, or has not drawn it yet
        time.sleep(0.03)
    raise AssertionError(f"timed out waiting for {what or fn} (last: {last!r})")


def rows(browser: Any) -> list[str]:
    return [tr.get_attribute("data-run")
            for tr in browser.find_elements(By.CSS_SELECTOR, "#runs tbody tr")]


def row(browser: Any, run_id: str) -> Any:
    found = browser.find_elements(By.CSS_SELECTOR, f'#runs tbody tr[data-run="{run_id}"]')
    return found[0] if found else None


def live(browser: Any) -> bool:
    return "on" in browser.find_element(By.ID, "live").get_attribute("class").split()


def screenshot(browser: Any, tmp_path: Path, name: str) -> None:
    browser.save_screenshot(str(tmp_path / name))
    target = os.environ.get("FENCEPOST_SCREENSHOT_DIR")
    if target:
        browser.save_screenshot(str(Path(target) / name))


def test_page_loads(browser: Any, web_server: WebServer) -> None:
    browser.get(web_server.url + "/")
    assert browser.title == "fencepost · runs"
    headers = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#runs thead th")]
    assert headers[:7] == ["RUN", "STATUS", "OWNER", "TOKEN", "ATTEMPT", "LEASE", "UPDATED"]
    wait_for(lambda: live(browser), what="the live badge")
    # the page works under its own Content-Security-Policy: nothing it uses is blocked
    assert [e for e in browser.get_log("browser") if "Content Security Policy" in e["message"]
            ] == []
    assert browser.execute_script("return document.styleSheets[0].cssRules.length") > 10


def test_an_acquired_run_appears_live_and_cancel_fences_its_worker(
    browser: Any, web_server: WebServer, workers: list[Worker], tmp_path: Path
) -> None:
    browser.get(web_server.url + "/")
    wait_for(lambda: live(browser), what="the live badge")
    browser.execute_script("window.__notReloaded = true;")
    worker = Worker(web_server.address, "live-job-1", "worker-live")
    workers.append(worker)
    assert worker.line().startswith("acquired")
    seen_at = time.monotonic()
    tr = wait_for(lambda: row(browser, "live-job-1"), timeout=5, what="the new row")
    appeared_after = time.monotonic() - seen_at
    print(f"\nthe acquired run appeared {appeared_after * 1000:.0f} ms after the acquire")
    assert appeared_after < 1.0, f"appeared {appeared_after:.2f}s after the acquire"
    assert browser.execute_script("return window.__notReloaded === true;")  # no reload
    assert "worker-live" in tr.text and "running" in tr.text
    lease_text = wait_for(lambda: row(browser, "live-job-1").find_element(
        By.CSS_SELECTOR, "td.lease").text, what="the lease cell")
    assert lease_text.endswith("s left") and "null" not in lease_text, lease_text

    button = row(browser, "live-job-1").find_element(
        By.CSS_SELECTOR, 'button[data-action="cancel"]')
    button.click()
    assert "confirm" in button.text  # asks once more
    button.click()
    assert worker.line() == "lost cancelled"  # the worker process was fenced
    wait_for(lambda: "cancelled" in row(browser, "live-job-1").text, what="the cancelled row")
    with SyncClient(web_server.address) as c:
        rec = c.get("live-job-1")
    assert rec.status is fencepost.RunStatus.CANCELLED
    assert rec.outcome is not None and rec.outcome.message == "cancelled from the dashboard"


def test_expired_and_lock_delay_leases_are_highlighted(
    browser: Any, web_server: WebServer
) -> None:
    import grpc

    from fencepost.v1 import ledger_pb2, ledger_pb2_grpc

    with grpc.insecure_channel(web_server.address) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        for run_id, delay in (("hl-expired", 0), ("hl-delay", 600_000)):
            stub.Acquire(ledger_pb2.AcquireRequest(run_id=run_id, owner="gone-worker",
                                                   lease_ttl_ms=100, lock_delay_ms=delay),
                         timeout=10)
    time.sleep(0.2)
    browser.get(web_server.url + "/?prefix=hl-")
    wait_for(lambda: len(rows(browser)) == 2, what="two rows")
    expired, delayed = row(browser, "hl-expired"), row(browser, "hl-delay")
    assert "expired" in expired.get_attribute("class").split() and "EXPIRED" in expired.text
    assert "lock-delay" in delayed.get_attribute("class").split()
    cell = delayed.find_element(By.CSS_SELECTOR, "td.lease").text
    assert cell.startswith("LOCK-DELAY 9m") and cell.endswith("s left"), cell
    cell = expired.find_element(By.CSS_SELECTOR, "td.lease").text
    assert cell.startswith("EXPIRED ") and cell.endswith(" ago"), cell
    resume = expired.find_elements(By.CSS_SELECTOR, 'button[data-action="resume"]')
    assert resume, "an expired lease can be resumed"
    resume[0].click()
    wait_for(lambda: "queued" in row(browser, "hl-expired").text, what="the resumed run")


def test_a_lease_renewed_from_memory_is_not_shown_expired(
    browser: Any, web_server: WebServer
) -> None:
    """Renewals make no change event (docs/SPEC.md §5.2): the pages read a
    running lease again as it nears its shown expiry, on either page."""
    import grpc

    from fencepost.v1 import ledger_pb2, ledger_pb2_grpc

    with grpc.insecure_channel(web_server.address) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        stub.Acquire(ledger_pb2.AcquireRequest(run_id="rn-held", owner="busy-worker",
                                               lease_ttl_ms=1500), timeout=10)
        for url in (web_server.url + "/?prefix=rn-", web_server.url + "/runs/rn-held"):
            browser.get(url)
            lease = ("#runs tbody tr[data-run=\"rn-held\"] td.lease" if "prefix" in url
                     else '#details .cell[data-key="lease"] .v')
            wait_for(lambda sel=lease: browser.find_elements(By.CSS_SELECTOR, sel),
                     what="the lease")
            for _ in range(8):  # 4 s, well past the expiry the acquire gave
                renewed = stub.Renew(ledger_pb2.RenewRequest(
                    run_id="rn-held", owner="busy-worker", fencing_token=1), timeout=10).run
                assert renewed.version == 1  # from memory: no change event for the page
                time.sleep(0.5)
                text = browser.find_element(By.CSS_SELECTOR, lease).text
                assert text.endswith("s left") and "EXPIRED" not in text, (url, text)


def test_filters_and_paging(browser: Any, web_server: WebServer) -> None:
    with SyncClient(web_server.address, owner="pager") as c:
        for i in range(60):
            c.acquire(f"page-{i:03d}").release()
        c.acquire("page-owned")
        c.acquire("page-susp").suspend(["approval-7"])
    browser.get(web_server.url + "/?prefix=page-&limit=25")
    wait_for(lambda: len(rows(browser)) == 25, what="a full page")
    assert rows(browser) == [f"page-{i:03d}" for i in range(25)]
    assert not browser.find_element(By.ID, "prev").is_enabled()
    browser.find_element(By.ID, "next").click()
    wait_for(lambda: rows(browser)[:1] == ["page-025"], what="page 2")
    assert rows(browser) == [f"page-{i:03d}" for i in range(25, 50)]
    browser.find_element(By.ID, "next").click()
    wait_for(lambda: rows(browser)[:1] == ["page-050"], what="page 3")
    assert rows(browser) == [*(f"page-{i:03d}" for i in range(50, 60)), "page-owned",
                             "page-susp"]
    assert not browser.find_element(By.ID, "next").is_enabled()
    browser.find_element(By.ID, "prev").click()
    wait_for(lambda: rows(browser)[:1] == ["page-025"], what="back to page 2")
    assert "after=page-024" not in browser.current_url  # the URL carries the cursor
    assert "before=page-050" in browser.current_url

    status = Select(browser.find_element(By.ID, "f-status"))
    status.select_by_visible_text("suspended")
    browser.find_element(By.ID, "f-apply").click()
    wait_for(lambda: rows(browser) == ["page-susp"], what="the status filter")
    status.select_by_visible_text("any")
    owner = browser.find_element(By.ID, "f-owner")
    owner.send_keys("pager")
    browser.find_element(By.ID, "f-apply").click()
    wait_for(lambda: rows(browser) == ["page-owned"], what="the owner filter")
    browser.find_element(By.ID, "f-clear").click()
    prefix = browser.find_element(By.ID, "f-prefix")
    prefix.send_keys("page-05")
    browser.find_element(By.ID, "f-apply").click()
    wait_for(lambda: rows(browser) == [f"page-{i:03d}" for i in range(50, 60)],
             what="the prefix filter")


def test_run_timeline(browser: Any, web_server: WebServer, tmp_path: Path) -> None:
    with SyncClient(web_server.address, owner="worker-a") as a:
        lease = a.acquire("timeline-1")
        lease.record_checkpoint("ckpt/1", 1)
        lease.renew()
        lease.suspend(["approval-1"])
        a.request_resume("timeline-1")
        lease = a.acquire("timeline-1")
        lease.record_checkpoint("ckpt/2", 2)
        lease.finish("completed")
    browser.get(web_server.url + "/runs/timeline-1")
    events = wait_for(lambda: [li.get_attribute("data-event") for li in
                               browser.find_elements(By.CSS_SELECTOR, "#timeline li")],
                      what="the timeline")
    # (the renewal was answered from memory: no change, no timeline entry)
    assert events == ["finished", "checkpointed", "acquired", "resumed", "suspended",
                      "checkpointed", "acquired"]
    assert browser.find_element(By.ID, "run-status").text == "completed"
    first = browser.find_elements(By.CSS_SELECTOR, "#timeline li")[-1]
    assert "worker-a" in first.text and "token 1" in first.text


def test_screenshots(browser: Any, workers: list[Worker], tmp_path: Path) -> None:
    """A realistic picture for the docs (a server of its own): live workers,
    an expired lease, every status, a run's whole timeline."""
    web_server = WebServer(tmp_path)
    web_server.start()
    try:
        _screenshots(browser, web_server, workers, tmp_path)
    finally:
        web_server.kill()


def _screenshots(
    browser: Any, web_server: WebServer, workers: list[Worker], tmp_path: Path
) -> None:
    import grpc

    from fencepost.v1 import ledger_pb2, ledger_pb2_grpc

    for i, owner in enumerate(("etl-worker-1", "etl-worker-2", "billing-7")):
        w = Worker(web_server.address, f"nightly-export-{i + 1}", owner, 45_000)
        workers.append(w)
        assert w.line().startswith("acquired")
    with grpc.insecure_channel(web_server.address) as ch:
        for run_id, owner, delay in (("nightly-export-4", "etl-worker-3", 0),
                                     ("nightly-export-5", "etl-worker-4", 30_000)):
            ledger_pb2_grpc.LedgerStub(ch).Acquire(ledger_pb2.AcquireRequest(
                run_id=run_id, owner=owner, lease_ttl_ms=100, lock_delay_ms=delay), timeout=10)
    with SyncClient(web_server.address, owner="billing-7") as c:
        c.acquire("invoice-2026-11").finish("completed")
        c.acquire("invoice-2026-12").finish("failed", "EXIT_3", "upstream timeout")
        c.acquire("reindex-users").suspend(["approval-42"])
        c.acquire("report-weekly").release()
        lease = c.acquire("ingest-orders")
        lease.record_checkpoint("orders/batch-0001", 1)
        lease.renew()
        lease.record_checkpoint("orders/batch-0002", 2)
        lease.suspend(["review-1"])
        c.request_resume("ingest-orders")
        lease = c.acquire("ingest-orders")
        lease.record_checkpoint("orders/batch-0003", 3)
        lease.finish("completed")
        c.acquire("cleanup-tmp")
        c.cancel("cleanup-tmp", "operator stop")
    time.sleep(0.3)
    browser.get(web_server.url + "/")
    wait_for(lambda: len(rows(browser)) == 11, what="the seeded rows")
    browser.execute_script("document.querySelector('#toast').hidden = true")
    screenshot(browser, tmp_path, "dashboard-runs.png")
    browser.get(web_server.url + "/runs/ingest-orders")
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#timeline li")) >= 8,
             what="the timeline")
    screenshot(browser, tmp_path, "dashboard-run.png")
    assert (tmp_path / "dashboard-runs.png").stat().st_size > 10_000


def test_the_token_typed_in_the_header_is_sent_with_every_request(
    browser: Any, tmp_path: Path
) -> None:
    """With bearer tokens on, the page sends the token typed in its header as
    ``authorization: Bearer`` with its reads, its live feed and its actions;
    without one the reads are refused, the page says so, and nothing changes."""
    from fencepost_server.auth import token_digest
    from fencepost_server.testing.server import ServerThread

    policy = tmp_path / "policy.toml"
    policy.write_text(f'[roles]\noperator = ["ops"]\nworker = ["w"]\n[tokens]\n'
                      f'ops = "{token_digest("s3cret")}"\nw = "{token_digest("w-token")}"\n')
    with ServerThread(tmp_path / "auth.db", authz=str(policy)) as srv:
        with SyncClient(srv.address, owner="w", token="w-token") as c:
            c.acquire("guarded")
        browser.get(srv.http_url + "/")
        toast = wait_for(lambda: browser.find_element(By.ID, "toast").text, what="the toast")
        assert "UNAUTHENTICATED" in toast
        wait_for(lambda: "UNAUTHENTICATED" in browser.find_element(By.ID, "live").text,
                 what="the live badge saying why it is off")
        assert row(browser, "guarded") is None
        token = browser.find_element(By.ID, "token")
        token.send_keys("s3cret")
        token.send_keys("\t")  # change event: kept for this tab, the page reloads with it
        wait_for(lambda: row(browser, "guarded") is not None, what="the row")
        wait_for(lambda: live(browser), what="the live badge")

        def twice() -> bool:
            """Arm the button, then confirm (found again if the row was redrawn)."""
            button = row(browser, "guarded").find_element(
                By.CSS_SELECTOR, 'button[data-action="cancel"]')
            button.click()
            button.click()
            return True

        wait_for(twice, what="the cancel button, clicked twice")
        wait_for(lambda: "cancelled" in row(browser, "guarded").text, what="the cancelled row")
        with SyncClient(srv.address, token="s3cret") as c:
            assert c.get("guarded").status is fencepost.RunStatus.CANCELLED
        browser.execute_script("sessionStorage.clear()")


def test_the_shards_view_lists_who_leads_each_shard(
    browser: Any, web_server: WebServer
) -> None:
    with SyncClient(web_server.address, owner="w-shards") as c:
        c.acquire("shard-view-run", ttl_ms=600_000)
        shard_count = c.shards().shard_count
    home = fencepost.shard_of("shard-view-run", shard_count)
    browser.get(web_server.url + "/?view=shards")
    assert "active" in browser.find_element(By.ID, "nav-shards").get_attribute("class")

    def shard_rows() -> list[Any]:
        return browser.find_elements(By.CSS_SELECTOR, "#shards tbody tr")

    wait_for(lambda: len(shard_rows()) == shard_count, what="a row per shard")
    cells = [td.text for td in browser.find_element(
        By.CSS_SELECTOR, f'#shards tbody tr[data-shard="{home}"]').find_elements(By.TAG_NAME, "td")]
    assert cells[0] == str(home) and cells[2] == web_server.address
    assert int(cells[4]) >= 1 and cells[5] == "1"  # runs, live leases
    assert "led by this coordinator" in browser.find_element(By.ID, "s-summary").text
