// The MemoryStore and RunJournal contract suites themselves: they pass
// correct stores and fail a store with any one of these flaws.
import assert from "node:assert/strict";
import { it } from "node:test";
import { runSuite } from "./suite-run.js";

const suite = (flaw: string) => runSuite("oma-memory-suite-target.js", { OMA_STORE_FLAW: flaw });

it("passes a correct in-memory store and journal", async () => {
  const r = await suite("none");
  assert.ok(r.ok, r.out);
  assert.match(r.out, /# fail 0/);
  assert.match(r.out, /# skipped 0/);
});

for (const [flaw, failing] of [
  ["cas-ignores-expected", "compareAndSet: null expects the key absent"],
  ["non-atomic-cas", "concurrent swaps from one value win"],
  ["set-resets-createdAt", "keeps createdAt when a key is overwritten"],
  ["aliases-metadata", "shares nothing with the caller"],
  ["list-unordered", "lists every present entry in key order"],
  ["ignores-seq", "readFrom\\(seq\\) returns the events with seq >= seq"],
  ["shared", "journals are apart"],
] as const) {
  it(`catches a store whose flaw is ${flaw}`, async () => {
    const r = await suite(flaw);
    assert.equal(r.ok, false, `the suite passed a store with ${flaw}`);
    assert.match(r.out, new RegExp(`not ok \\d+ - [^\\n]*${failing}`));
  });
}
