#!/usr/bin/env node
// Run the built tests (packages/tests/dist/*.test.js) with node:test; every
// test file starts the fencepost servers it needs. Arguments filter files
// by name: `node scripts/test.mjs oma chamvi`.
import { spawnSync } from "node:child_process";
import { readdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const dist = join(dirname(fileURLToPath(import.meta.url)), "..", "packages", "tests", "dist");
const filters = process.argv.slice(2);
const files = readdirSync(dist).filter((f) => f.endsWith(".test.js"))
  .filter((f) => filters.length === 0 || filters.some((x) => f.includes(x))).sort().map((f) => join(dist, f));
if (files.length === 0) {
  console.error("no test files matched");
  process.exit(1);
}
const r = spawnSync(process.execPath, ["--test", "--test-concurrency=2", "--test-timeout=120000", ...files], { stdio: "inherit" });
process.exit(r.status ?? 1);
