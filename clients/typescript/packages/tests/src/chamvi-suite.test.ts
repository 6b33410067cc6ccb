// The IStore contract suite itself: it passes a correct store and fails a
// store with any one of these flaws.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { it } from "node:test";

const run = promisify(execFile);
const target = fileURLToPath(new URL("./chamvi-suite-target.js", import.meta.url));

async function suite(flaw: string): Promise<{ ok: boolean; out: string }> {
  const env: NodeJS.ProcessEnv = { ...process.env, STORE_FLAW: flaw };
  delete env["NODE_TEST_CONTEXT"]; // a run of its own, not a child of this test runner
  try {
    const { stdout } = await run(process.execPath, ["--test", "--test-reporter=tap", target], { timeout: 60_000, env });
    return { ok: true, out: stdout };
  } catch (e) {
    return { ok: false, out: String((e as { stdout?: string }).stdout) };
  }
}

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
