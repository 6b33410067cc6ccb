#!/usr/bin/env node
// Regenerate the TypeScript stubs from proto/ (npm run generate; make proto).
//
//   node scripts/generate.mjs OUT_DIR
//
// Runs protoc (the one in the project's Python environment, grpcio-tools, so
// the Python and TypeScript stubs come from the same compiler) with
// protoc-gen-es over proto/fencepost/v1/*.proto and the google.rpc protos the
// errors need (status.proto, error_details.proto, shipped as .proto files by
// googleapis-common-protos). The codegen test runs this into a temporary
// directory and compares, so stale stubs fail the tests.
import { execFileSync } from "node:child_process";
import { existsSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const tsRoot = resolve(here, "..");
const repo = resolve(tsRoot, "..", "..");
const out = resolve(process.argv[2] ?? join(tsRoot, "packages/client/src/gen"));
const python = process.env.FENCEPOST_PYTHON ?? join(repo, ".venv/bin/python");
if (!existsSync(python)) {
  console.error(`no Python environment at ${python}: run \`make lint\` in the repository first (or set FENCEPOST_PYTHON)`);
  process.exit(2);
}
// Where grpcio-tools keeps the well-known types and googleapis-common-protos the google.rpc ones.
const [wellKnown, common] = execFileSync(python, ["-c", [
  "import os, grpc_tools, google.rpc.status_pb2 as s",
  "print(os.path.join(os.path.dirname(grpc_tools.__file__), '_proto'))",
  "print(os.path.dirname(os.path.dirname(os.path.dirname(s.__file__))))",
].join("\n")], { encoding: "utf8" }).trim().split("\n");

const protoRoot = join(repo, "proto");
const ours = readdirSync(join(protoRoot, "fencepost/v1")).filter((f) => f.endsWith(".proto")).sort()
  .map((f) => `fencepost/v1/${f}`);
const files = [...ours, "google/rpc/status.proto", "google/rpc/error_details.proto"];

rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
execFileSync(python, [
  "-m", "grpc_tools.protoc",
  `-I${protoRoot}`, `-I${common}`, `-I${wellKnown}`,
  `--plugin=protoc-gen-es=${join(tsRoot, "node_modules/.bin/protoc-gen-es")}`,
  `--es_out=${out}`,
  "--es_opt=target=ts,import_extension=js",
  ...files,
], { stdio: "inherit", cwd: tsRoot });
for (const f of files) console.log(join(out, f.replace(/\.proto$/, "_pb.ts")));
