// The IStore contract suite itself: it passes a correct store and fails a
// store with any one of these flaws.
import assert from "node:assert/strict";
import { it } from "node:test";
import { runSuite } from "./suite-run.js";

const suite = (flaw: string) => runSuite("chamvi-suite-target.js", { STORE_FLAW: flaw });

it("passes a correct in-memory store", async () => {
  const r = await suite("none");
  assert.ok(r.ok, r.out);
  assert.match(r.out, /# fail 0/);
});

for (const [flaw, failing] of [
  ["claim-ignores-expiry", "claimRun succeeds only when unclaimed or expired"],
  ["list-unordered", "listRuns orders by createdAt then id"],
  ["aliasing", "values are copied in and out"],
  ["artifact-buffer", "putArtifact is insert-if-absent"],
] as const) {
  it(`catches a store with the flaw ${flaw}`, async () => {
    const r = await suite(flaw);
    assert.equal(r.ok, false, `the suite passed a store with ${flaw}`);
    assert.match(r.out, new RegExp(`not ok \\d+ - [^\\n]*${failing}`));
  });
}
