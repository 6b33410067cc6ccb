// Run a contract suite target (a node:test file) in a node process of its
// own, with extra environment, and return whether it passed and its TAP output.
import { execFile } from "node:child_process";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const run = promisify(execFile);

export async function runSuite(file: string, extraEnv: Record<string, string>): Promise<{ ok: boolean; out: string }> {
  const target = fileURLToPath(new URL(`./${file}`, import.meta.url));
  const env: NodeJS.ProcessEnv = { ...process.env, ...extraEnv };
  delete env["NODE_TEST_CONTEXT"]; // a run of its own, not a child of this test runner
  try {
    const { stdout } = await run(process.execPath, ["--test", "--test-reporter=tap", target], { timeout: 60_000, env });
    return { ok: true, out: stdout };
  } catch (e) {
    return { ok: false, out: String((e as { stdout?: string }).stdout) };
  }
}
