// Runs the MemoryStore and RunJournal contract suites against small
// in-memory implementations, correct or with one flaw (OMA_STORE_FLAW), so
// that oma-memory-suite.test.ts can check the suites pass a correct store and
// catch each flaw.
import { runMemoryStoreContractSuite, runRunJournalContractSuite } from "@fencepost/oma/contract";
import type { MemoryEntry, MemoryStore, RunEvent, RunJournal } from "@fencepost/oma";

const flaw = process.env["OMA_STORE_FLAW"] ?? "none";
const rows = new Map<string, MemoryEntry>();
const copy = <T>(v: T): T => (v === undefined ? v : (JSON.parse(JSON.stringify(v)) as T));

class MapStore implements MemoryStore {
  async get(key: string): Promise<MemoryEntry | null> {
    const e = rows.get(key);
    return e === undefined ? null : { ...e, ...(e.metadata === undefined ? {} : { metadata: flaw === "aliases-metadata" ? e.metadata : copy(e.metadata) }) };
  }
  async set(key: string, value: string, metadata?: Record<string, unknown>): Promise<void> {
    this.put(key, value, metadata, undefined);
  }
  async setWithExpiry(key: string, value: string, expiresAtTurn: number, metadata?: Record<string, unknown>): Promise<void> {
    this.put(key, value, metadata, expiresAtTurn);
  }
  async compareAndSet(key: string, expected: string | null, value: string, metadata?: Record<string, unknown>): Promise<boolean> {
    const cur = rows.get(key);
    if (flaw === "non-atomic-cas") await new Promise((r) => setTimeout(r, 1));
    if (flaw !== "cas-ignores-expected" && (expected === null ? cur !== undefined : cur?.value !== expected)) return false;
    if (flaw === "non-atomic-cas") await new Promise((r) => setTimeout(r, 1));
    this.put(key, value, metadata, undefined);
    return true;
  }
  async list(): Promise<MemoryEntry[]> {
    const entries = await Promise.all([...rows.keys()].map(async (k) => (await this.get(k))!));
    return flaw === "list-unordered" ? entries : entries.sort((a, b) => (a.key < b.key ? -1 : a.key > b.key ? 1 : 0));
  }
  async delete(key: string): Promise<void> {
    rows.delete(key);
  }
  async clear(): Promise<void> {
    rows.clear();
  }
  private put(key: string, value: string, metadata: Record<string, unknown> | undefined, expiresAtTurn: number | undefined): void {
    const createdAt = flaw === "set-resets-createdAt" ? new Date() : (rows.get(key)?.createdAt ?? new Date());
    rows.set(key, {
      key, value, createdAt,
      ...(metadata === undefined ? {} : { metadata: flaw === "aliases-metadata" ? metadata : copy(metadata) }),
      ...(expiresAtTurn === undefined ? {} : { expiresAtTurn }),
    });
  }
}

const journals = new Map<string, RunEvent[]>();
class ArrayJournal implements RunJournal {
  constructor(private readonly events: RunEvent[]) {}
  async append(events: readonly RunEvent[]): Promise<void> {
    this.events.push(...copy([...events]));
  }
  async readFrom(seq: number): Promise<RunEvent[]> {
    return copy(this.events.filter((e) => flaw === "ignores-seq" || e.seq >= seq));
  }
  async close(): Promise<void> {}
  describe() {
    return { kind: "ArrayJournal" };
  }
}

runMemoryStoreContractSuite(`map (${flaw})`, () => new MapStore(), { largeValue: 1024 * 1024 });
runRunJournalContractSuite(`array (${flaw})`, (name) => {
  const key = flaw === "shared" ? "one" : name;
  if (!journals.has(key)) journals.set(key, []);
  return new ArrayJournal(journals.get(key)!);
});
