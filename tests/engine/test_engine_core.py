"""The engine store's pure decisions and input rules (core/engine.py), without a server."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fencepost_server.core import codec
from fencepost_server.core import engine as E
from fencepost_server.core.errors import Code, LedgerError

T = 1_000_000
D = 5_000


def run(**kw: Any) -> E.Run:
    base: dict[str, Any] = dict(
        id="r",
        agent="a",
        status="queued",
        concurrency_key=None,
        input=None,
        output=None,
        error=None,
        metadata=None,
        claim=None,
        created_at=T,
        updated_at=T,
    )
    base.update(kw)
    return E.Run(**base)


# -- the one expiry rule ------------------------------------------------------------------


@pytest.mark.parametrize(("now", "live"), [(T + D - 1, True), (T + D, False), (T + D + 1, False)])
def test_expiry_rule_is_live_until_exactly_t_plus_d(now: int, live: bool) -> None:
    assert E.is_live(T + D, now) is live


@pytest.mark.parametrize(("at", "taken"), [(T + D - 1, False), (T + D, True)])
def test_claim_key_lock_taken_over_exactly_at_expiry(at: int, taken: bool) -> None:
    claimed = run(claim=E.Claim("w1", T + D))
    new, res = E.decide_claim_run(claimed, E.ClaimRun("r", "w2", D), at)
    assert res.ok is taken and (new is not None) is taken
    hold = E.KeyHold("s", "k", "run-1", T + D)
    _, key = E.decide_claim_key(hold, E.ClaimKey("s", "k", "run-2", D), at)
    assert key.created is taken and key.run_id == ("run-2" if taken else "run-1")
    lock = E.Lock("k", "w1", 7, T + D)
    _, ans = E.decide_acquire_lock(lock, E.AcquireLock("k", "w2", D), at)
    assert ans.acquired is taken
    assert ans.fencing_token == (8 if taken else 7) and ans.owner == ("w2" if taken else "w1")
    _, rres = E.decide_renew_claim(claimed, E.RenewClaim("r", "w1", D), at)
    assert rres.ok is not taken, "the owner renews only while live"


# -- runs ----------------------------------------------------------------------------------


def test_create_run_is_insert_if_absent() -> None:
    cmd = E.CreateRun("r", "a", "queued", input='{"x":1}')
    new, res = E.decide_create_run(None, cmd, T)
    assert res.created and new == res.run and new.created_at == new.updated_at == T
    stored = run(status="running")
    new, res = E.decide_create_run(stored, cmd, T + 5)
    assert new is None and not res.created and res.run is stored


def test_update_run_guards() -> None:
    cur = run(status="running", claim=E.Claim("w1", T + 10))
    patch = E.RunPatch(status="done")

    def code(**kw: Any) -> Code | None:
        try:
            E.decide_update_run(kw.pop("current", cur), E.UpdateRun("r", patch, **kw), T)
        except LedgerError as exc:
            return exc.code
        return None

    assert code(current=None) is Code.RUN_NOT_FOUND
    assert code(expect_status=("queued",)) is Code.INVALID_RUN_STATE
    assert code(expect_status=("queued", "running")) is None
    assert code(expect_owner="w2") is Code.INVALID_RUN_STATE
    assert code(expect_owner="w1") is None
    assert code(current=run(), expect_owner="w1") is Code.INVALID_RUN_STATE
    # expiry is not checked by the owner guard
    expired = run(claim=E.Claim("w1", T - 1))
    assert code(current=expired, expect_owner="w1") is None


def test_update_run_patch_sets_clears_and_keeps() -> None:
    cur = run(input='{"a":1}', output='"o"', concurrency_key="ck", claim=E.Claim("w", T + 9))
    patch = E.RunPatch(status="running", error="null", clear=("output", "claim"))
    new = E.decide_update_run(cur, E.UpdateRun("r", patch), T + 3)
    assert (new.status, new.error, new.output, new.claim) == ("running", "null", None, None)
    assert (new.input, new.concurrency_key, new.created_at, new.updated_at) == (
        '{"a":1}',
        "ck",
        T,
        T + 3,
    )


def test_claim_run_refuses_any_live_claim_and_unknown_runs() -> None:
    assert E.decide_claim_run(None, E.ClaimRun("r", "w", D), T) == (None, E.RunClaimed(False, None))
    live = run(claim=E.Claim("w", T + 1))
    new, res = E.decide_claim_run(live, E.ClaimRun("r", "w", D), T)
    assert new is None and not res.ok and res.run is live, "even the owner's own live claim"
    new, res = E.decide_claim_run(run(), E.ClaimRun("r", "w", D), T)
    assert res.ok and new is not None and new.claim == E.Claim("w", T + D) and new.updated_at == T


def test_renew_claim_only_by_the_live_owner() -> None:
    live = run(claim=E.Claim("w", T + 1))
    assert not E.decide_renew_claim(live, E.RenewClaim("r", "x", D), T)[1].ok
    assert not E.decide_renew_claim(run(), E.RenewClaim("r", "w", D), T)[1].ok
    assert not E.decide_renew_claim(None, E.RenewClaim("r", "w", D), T)[1].ok
    new, res = E.decide_renew_claim(live, E.RenewClaim("r", "w", D), T)
    assert res.ok and new is not None and new.claim == E.Claim("w", T + D)


# -- steps, checkpoints, locks ----------------------------------------------------------------


def test_steps_get_the_next_position() -> None:
    step = E.decide_append_step(4, E.AppendStep("r", "n", output="1"), T)
    assert (step.seq, step.output, step.created_at) == (5, "1", T)


@pytest.mark.parametrize(
    ("stored", "index", "saved"), [(None, 0, True), (5, 6, True), (5, 5, True), (5, 4, False)]
)
def test_checkpoint_keeps_the_highest_index(stored: int | None, index: int, saved: bool) -> None:
    cur = E.Checkpoint("r", stored, '"old"', T - 1) if stored is not None else None
    new, res = E.decide_save_checkpoint(cur, E.SaveCheckpoint("r", index, '"new"'), T)
    assert res.saved is saved and (new is not None) is saved
    assert res.checkpoint.state == ('"new"' if saved else '"old"')


def test_lock_tokens_move_exactly_when_the_holder_changes() -> None:
    new, a = E.decide_acquire_lock(None, E.AcquireLock("k", "a", D), T)
    assert a.acquired and a.fencing_token == 1 and new is not None
    ext, again = E.decide_acquire_lock(new, E.AcquireLock("k", "a", D), T + 1)
    assert again.acquired and again.fencing_token == 1 and again.expires_at == T + 1 + D
    assert ext is not None
    none, held = E.decide_acquire_lock(ext, E.AcquireLock("k", "b", D), T + 2)
    assert none is None and not held.acquired and held.owner == "a"
    freed, rel = E.decide_release_lock(ext, E.ReleaseLock("k", "b"), T + 3)
    assert freed is None and not rel.ok, "a non-owner's release changes nothing"
    freed, rel = E.decide_release_lock(ext, E.ReleaseLock("k", "a"), T + 3)
    assert rel.ok and freed is not None and freed.owner is None and freed.fencing_token == 1
    _, b = E.decide_acquire_lock(freed, E.AcquireLock("k", "b", D), T + 4)
    assert b.acquired and b.fencing_token == 2
    _, a2 = E.decide_acquire_lock(freed, E.AcquireLock("k", "a", D), T + 4)
    assert a2.fencing_token == 2, "a new grant after a release moves the token"


def test_commit_artifact_insert_if_absent_and_exact_size() -> None:
    cmd = E.CommitArtifact("x", "r", "", "", 10, "ab" * 32, None, upload_id="u1")
    new, res = E.decide_commit_artifact(None, cmd, 10, T)
    assert res.created and new is not None and res.upload_id == "u1"
    new2, res2 = E.decide_commit_artifact(new, cmd, 10, T)
    assert new2 is None and not res2.created and res2.artifact is new and res2.upload_id == ""
    with pytest.raises(LedgerError) as ei:
        E.decide_commit_artifact(None, cmd, 9, T)
    assert ei.value.code is Code.RUN_VALIDATION_ERROR


def test_commit_artifact_fingerprint_ignores_the_upload() -> None:
    """A retry stages its bytes under another upload id: same request."""
    a = E.CommitArtifact("x", "r", "", "", 1, "0" * 64, None, upload_id="u1", request_id="q")
    b = E.CommitArtifact("x", "r", "", "", 1, "0" * 64, None, upload_id="u2", request_id="q")
    c = E.CommitArtifact("x", "r", "", "", 1, "1" * 64, None, upload_id="u1", request_id="q")
    assert codec.fingerprint(a) == codec.fingerprint(b) != codec.fingerprint(c)


# -- JSON ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "",
        "NaN",
        "Infinity",
        "-Infinity",
        "[NaN]",
        '{"a":1,}',
        "[1] [2]",
        "'x'",
        "01",
        "+1",
        '"\x01"',
        "[" * 100_000,
    ],
)
def test_malformed_json_is_refused_naming_the_field(text: str) -> None:
    with pytest.raises(LedgerError) as ei:
        E.json_text("run.input", text)
    assert ei.value.code is Code.RUN_VALIDATION_ERROR and ei.value.field == "run.input"


@pytest.mark.parametrize(
    "text",
    [
        "null",
        " null ",
        "123456789012345678901234567890",
        '{"a":[1,{"b":null}]}',
        '"🎉"',
        "1e400",
        '"\\u0000"',
        "-0",
        "1.10",
    ],
)
def test_valid_json_is_kept_byte_for_byte(text: str) -> None:
    assert E.json_text("v", text) is text


def test_where_accepts_top_level_equality_only() -> None:
    assert E.parse_where(None) == {}
    assert E.parse_where('{"a": {"b": 1}, "c": [1]}') == {"a": {"b": 1}, "c": [1]}
    for bad in ("[1]", "1", "null", '{"a.b": 1}', '{"$or": []}', '{"a": {"$gt": 1}}'):
        with pytest.raises(LedgerError) as ei:
            E.parse_where(bad)
        assert ei.value.field is not None and ei.value.field.startswith("where")


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (1, 1, True),
        (1, Decimal("1.0"), True),
        (True, 1, False),
        (False, 0, False),
        (None, None, True),
        (None, False, False),
        ("1", 1, False),
        ([1, {"a": None}], [1, {"a": None}], True),
        ([1, 2], [2, 1], False),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        (2**70, 2**70 + 1, False),
        (Decimal("0.1"), Decimal("0.10"), True),
    ],
)
def test_json_equality_is_strict(a: Any, b: Any, equal: bool) -> None:
    assert E.json_equal(a, b) is equal and E.json_equal(b, a) is equal


def test_doc_matches_top_level_fields() -> None:
    doc = '{"k": "a", "n": 12345678901234567890123, "o": {"x": [1]}, "z": null}'
    assert E.doc_matches(doc, {})
    assert E.doc_matches(doc, {"k": "a", "n": 12345678901234567890123})
    assert not E.doc_matches(doc, {"n": 12345678901234567890124})
    assert E.doc_matches(doc, {"o": {"x": [1]}, "z": None})
    assert not E.doc_matches(doc, {"x": [1]})
    assert not E.doc_matches(doc, {"missing": None})


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values)
def test_any_json_value_is_accepted_and_equal_to_itself(value: Any) -> None:
    import json

    text = json.dumps(value, ensure_ascii=False)
    assert E.json_text("v", text) == text
    parsed = E.parse_json("v", text)
    assert E.json_equal(parsed, E.parse_json("v", json.dumps(value)))


# -- the request-id cache ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        E.RunCreated(True, run(claim=E.Claim("w", 5), input='{"n":1}')),
        E.RunClaimed(False, None),
        E.RunClaimed(True, run(claim=E.Claim("w", 5))),
        run(),
        E.Step("r", 1, "n", None, None, "1", None, None, T),
        E.CheckpointSaved(True, E.Checkpoint("r", 3, "null", T)),
        E.KeyClaimed(False, "run-1", T + D),
        E.LockAnswer(True, 4, "w", T),
        E.Done(True, T),
        E.DocUpserted(False, E.Doc("d", "{}", T)),
        E.ArtifactCommitted(True, E.Artifact("x", "r", "n", "t", 3, "0" * 64, None, T), "u"),
        E.Staged("u", 0, 10),
    ],
)
def test_every_result_round_trips_through_the_request_cache(answer: Any) -> None:
    import json

    stored = json.loads(json.dumps(codec.encode(answer)))
    assert codec.decode(stored) == answer
