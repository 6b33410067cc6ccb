// The committed TypeScript stubs are exactly what `npm run generate` makes
// from proto/ today: a proto change without regenerated stubs fails here.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";
import { fileURLToPath } from "node:url";
import { it } from "node:test";

const root = fileURLToPath(new URL("../../..", import.meta.url));
const committed = join(root, "packages/client/src/gen");

function files(dir: string): string[] {
  return readdirSync(dir).flatMap((f) => {
    const p = join(dir, f);
    return statSync(p).isDirectory() ? files(p) : [p];
  });
}

it("the generated stubs are up to date with proto/", () => {
  const out = mkdtempSync(join(tmpdir(), "fencepost-gen-"));
  try {
    execFileSync(process.execPath, [join(root, "scripts/generate.mjs"), out], { stdio: "pipe" });
    const fresh = files(out).map((f) => relative(out, f)).sort();
    const have = files(committed).map((f) => relative(committed, f)).sort();
    assert.deepEqual(have, fresh, "the set of generated files differs: run `npm run generate` (or `make proto`)");
    assert.ok(fresh.includes("google/rpc/status_pb.ts") && fresh.includes("google/rpc/error_details_pb.ts"));
    for (const f of fresh) {
      assert.equal(readFileSync(join(committed, f), "utf8"), readFileSync(join(out, f), "utf8"),
        `${f} is stale: run \`npm run generate\` in clients/typescript (or \`make proto\`)`);
    }
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
});
