// A push queue read as an AsyncIterable: the request side of a client or
// bidirectional stream. Read by one consumer.
export class AsyncQueue<T> implements AsyncIterable<T> {
  private items: T[] = [];
  private wake: (() => void) | undefined;
  private closed = false;

  push(item: T): void {
    if (this.closed) return;
    this.items.push(item);
    this.notify();
  }

  close(): void {
    this.closed = true;
    this.notify();
  }

  get isClosed(): boolean {
    return this.closed;
  }

  private notify(): void {
    const w = this.wake;
    this.wake = undefined;
    w?.();
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<T, void, undefined> {
    try {
      for (;;) {
        if (this.items.length) {
          yield this.items.shift() as T;
        } else if (this.closed) {
          return;
        } else {
          await new Promise<void>((resolve) => { this.wake = resolve; });
        }
      }
    } finally {
      this.closed = true;
    }
  }
}
