// Certificates and a policy for tests, made by the repository's test CA
// (helpers/make_certs.py): ca.pem, NAME.pem and NAME-key.pem for the
// principals alice, bob, op and admin, and policy.toml with three tokens
// (admin, operator "script", worker "carol").
import { execFileSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { findFencepostBin } from "@fencepost/client/testing";

export interface Certs {
  ca: string;
  server: { cert: string; key: string };
  clients: Record<string, { cert: string; key: string }>;
  policy: string;
  tokens: { admin: string; script: string; worker: string };
}

export function makeCerts(dir: string): Certs {
  const python = join(dirname(findFencepostBin()), "python");
  const script = join(dirname(fileURLToPath(import.meta.url)), "..", "helpers", "make_certs.py");
  return JSON.parse(execFileSync(python, [script, dir], { encoding: "utf8" })) as Certs;
}

/** `fencepost serve` flags for mutual TLS with the policy. */
export function mtlsArgs(certs: Certs): string[] {
  return ["--tls-cert", certs.server.cert, "--tls-key", certs.server.key, "--client-ca", certs.ca, "--authz", certs.policy];
}
