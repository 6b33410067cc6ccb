// Runs the RunStore contract suite against a small in-memory store, correct or
// with one flaw (RUN_STORE_FLAW), so that oma-suite.test.ts can check the suite
// passes a correct store and catches each flaw.
import { runRunStoreContractSuite } from "@fencepost/oma/contract";
import type { RunRecord, RunStore } from "@fencepost/oma";

const flaw = process.env["RUN_STORE_FLAW"] ?? "none";
const rows = new Map<string, string>();

class MemoryRunStore implements RunStore {
  readonly atomicity = "process" as const;
  async get(runId: string): Promise<RunRecord | null> {
    const row = rows.get(runId);
    return row === undefined ? null : (JSON.parse(row) as RunRecord);
  }
  async create(record: RunRecord): Promise<boolean> {
    if (rows.has(record.runId) && flaw !== "create-overwrites") return false;
    rows.set(record.runId, JSON.stringify(record));
    return true;
  }
  async compareAndSet(runId: string, expectedVersion: number, next: RunRecord): Promise<boolean> {
    const cur = rows.get(runId);
    if (cur === undefined) return false;
    if ((JSON.parse(cur) as RunRecord).version !== expectedVersion && flaw !== "cas-ignores-version") return false;
    if (next.version !== expectedVersion + 1) return false;
    rows.set(runId, JSON.stringify(flaw === "cas-drops-fields" ? { ...next, checkpointRef: undefined } : next));
    return true;
  }
  async delete(runId: string): Promise<void> {
    rows.delete(runId);
  }
}

runRunStoreContractSuite(`memory (${flaw})`, () => new MemoryRunStore());
