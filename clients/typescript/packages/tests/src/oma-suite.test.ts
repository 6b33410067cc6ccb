// The RunStore contract suite itself: it passes a correct store and fails a
// store with any one of these flaws.
import assert from "node:assert/strict";
import { it } from "node:test";
import { runSuite } from "./suite-run.js";

const suite = (flaw: string) => runSuite("oma-suite-target.js", { RUN_STORE_FLAW: flaw });

it("passes a correct in-memory store", async () => {
  const r = await suite("none");
  assert.ok(r.ok, r.out);
  assert.match(r.out, /# fail 0/);
});

for (const [flaw, failing] of [
  ["create-overwrites", "creates only when absent"],
  ["cas-ignores-version", "swaps only at the stored version"],
  ["cas-drops-fields", "concurrent swaps"],
] as const) {
  it(`catches a store whose ${flaw}`, async () => {
    const r = await suite(flaw);
    assert.equal(r.ok, false, `the suite passed a store whose ${flaw}`);
    assert.match(r.out, new RegExp(`not ok \\d+ - [^\\n]*${failing}`));
  });
}
