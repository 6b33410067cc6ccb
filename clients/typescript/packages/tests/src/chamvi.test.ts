import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { startServer, type TestServer } from "@fencepost/client/testing";
import { FencepostStore, InvalidRunStateError, RunNotFoundError } from "@fencepost/chamvi";
import { runStoreContractSuite } from "@fencepost/chamvi/contract";
import { ValidationError } from "@fencepost/client";

let server: TestServer;
before(async () => { server = await startServer(); });
after(async () => { await server.stop(); });

runStoreContractSuite("FencepostStore", async () => {
  const store = await FencepostStore.connect(server.address);
  return { store, clock: store.testClock(), close: () => store.close() };
});

describe("FencepostStore on fencepost", () => {
  let store: FencepostStore;
  before(async () => { store = await FencepostStore.connect(server.address); });
  after(async () => { await store.close(); });

  it("throws the contract's error classes", async () => {
    await store.createRun({ id: "ch-guard", agent: "a", status: "queued" });
    await assert.rejects(store.updateRun("ch-guard", { status: "x" }, { expectStatus: ["running"] }), InvalidRunStateError);
    await assert.rejects(store.updateRun("ch-unknown", { status: "x" }), RunNotFoundError);
  });

  it("refuses bad input naming the field, and changes nothing", async () => {
    await assert.rejects(store.createRun({ id: "", agent: "a", status: "q" }), (e: unknown) => e instanceof ValidationError && e.field === "run.id");
    await assert.rejects(store.claimRun("ch-guard", "w", 0), (e: unknown) => e instanceof ValidationError && e.field === "ttl_ms");
    await assert.rejects(store.kvSet("a", "k", { big: 10n }), (e: unknown) => e instanceof ValidationError && e.field === "value");
    await assert.rejects(store.docUpsert("a", "c", "d", [1, 2]), (e: unknown) => e instanceof ValidationError && e.field === "doc");
    await assert.rejects(store.docList("a", "c", { where: { "a.b": 1 } }), (e: unknown) => e instanceof ValidationError);
    await assert.rejects(store.updateRun("ch-guard", { claim: { owner: "x", expiresAt: new Date() } }), (e: unknown) => e instanceof ValidationError && e.field === "patch.claim");
    assert.equal((await store.getRun("ch-guard"))?.claim, undefined);
    assert.equal(await store.kvGet("a", "k"), undefined);
  });

  it("releases a claim with claim: undefined", async () => {
    await store.createRun({ id: "ch-release", agent: "a", status: "queued" });
    assert.equal(await store.claimRun("ch-release", "w1", 60_000), true);
    const r = await store.updateRun("ch-release", { claim: undefined }, { expectOwner: "w1" });
    assert.equal(r.claim, undefined);
    assert.equal(await store.claimRun("ch-release", "w2", 60_000), true);
  });

  it("streams artifacts in chunks both ways", async () => {
    const chunk = new Uint8Array(100_000).fill(7);
    async function* parts() { for (let i = 0; i < 5; i++) yield chunk; }
    assert.equal(await store.putArtifactStream({ id: "ch-stream", runId: "r", size: 500_000 }, parts()), true);
    let total = 0;
    let pieces = 0;
    for await (const c of store.readArtifactChunks("ch-stream")) { total += c.length; pieces++; assert.ok(c.every((b) => b === 7)); }
    assert.equal(total, 500_000);
    assert.ok(pieces >= 2, `read in ${pieces} chunk(s)`);
    assert.equal((await store.getArtifact("ch-stream"))?.size, 500_000);
    await assert.rejects(store.putArtifactStream({ id: "ch-short", runId: "r", size: 10 }, [new Uint8Array(3)]), ValidationError);
    assert.equal(await store.getArtifact("ch-short"), undefined, "a short upload stores nothing");
  });
});
