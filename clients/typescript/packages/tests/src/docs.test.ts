// docs/TYPESCRIPT.md shows each example file verbatim, and each example runs
// (twice in a row, as a user would re-run it) against a real server; where
// the page shows what an example prints ("It prints:" and a block right
// after it), each run prints exactly that.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { after, before, describe, it } from "node:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { freePort, startServer, type TestServer } from "@fencepost/client/testing";
import { makeCerts, mtlsArgs } from "./pki.js";

const run = promisify(execFile);
const here = fileURLToPath(new URL(".", import.meta.url));
const srcExamples = join(here, "..", "src", "examples");
const distExamples = join(here, "examples");
// the client's page and the engines' adapters' page, read as one
const docs = join(here, "..", "..", "..", "..", "..", "docs");
const doc = ["TYPESCRIPT.md", "TYPESCRIPT_ENGINES.md"].map((f) => readFileSync(join(docs, f), "utf8")).join("\n");
const blocks = [...doc.matchAll(/```ts\n([\s\S]*?)```/g)].map((m) => m[1]!);
const examples = readdirSync(srcExamples).filter((f) => f.endsWith(".ts")).sort();

/** The output the page shows right after an example's block, if it shows one. */
function printed(example: string): string | undefined {
  const at = doc.indexOf("```ts\n" + example + "```");
  if (at < 0) return undefined;
  const m = /^\n*It prints:\n\n```\n([\s\S]*?)```/.exec(doc.slice(at + example.length + 9));
  return m?.[1];
}

let server: TestServer;
// for the examples that read FENCEPOST_PKI: a mutual-TLS server, listed after a coordinator that is down
let secure: TestServer;
let pki: string;
let endpoints: string;
before(async () => {
  server = await startServer();
  pki = mkdtempSync(join(tmpdir(), "fencepost-ts-pki-"));
  const certs = makeCerts(pki);
  const admin = certs.clients["admin"]!;
  secure = await startServer({
    args: mtlsArgs(certs),
    connect: { tls: { ca: readFileSync(certs.ca), cert: readFileSync(admin.cert), key: readFileSync(admin.key) } },
  });
  endpoints = `127.0.0.1:${await freePort()},${secure.address}`;
});
after(async () => {
  await server.stop();
  await secure?.stop();
  rmSync(pki, { recursive: true, force: true });
});

describe("docs/TYPESCRIPT.md", () => {
  it("shows every example file verbatim, and no other ts block", () => {
    assert.ok(examples.length >= 4);
    assert.ok(printed(readFileSync(join(srcExamples, "fencing.ts"), "utf8")), "the fencing example shows its output");
    const files = new Map(examples.map((f) => [f, readFileSync(join(srcExamples, f), "utf8")]));
    for (const [f, text] of files) assert.ok(blocks.includes(text), `${f} is not shown verbatim in docs/TYPESCRIPT*.md`);
    for (const b of blocks) {
      assert.ok(b.startsWith("// fragment") || [...files.values()].includes(b), `a ts block is not an example file:\n${b.slice(0, 200)}`);
    }
  });

  for (const f of examples) {
    it(`example ${f} runs twice in a row`, async () => {
      for (let i = 0; i < 2; i++) {
        const { stdout } = await run(process.execPath, [join(distExamples, f.replace(/\.ts$/, ".js"))], {
          env: { ...process.env, FENCEPOST_ADDR: server.address, FENCEPOST_ENDPOINTS: endpoints, FENCEPOST_PKI: pki },
          timeout: 60_000,
        });
        assert.ok(stdout.length > 0);
        const shown = printed(readFileSync(join(srcExamples, f), "utf8"));
        if (shown !== undefined) assert.equal(stdout, shown, `${f} (run ${i + 1}) does not print what docs/TYPESCRIPT.md shows`);
      }
    });
  }
});
