//! The channel from a generation's engine thread to its HTTP response, with a
//! bound on how long a client can hold the generation turn without reading.
//!
//! Two rules, both with the write timeout as their limit. A piece the response
//! has not taken (handed to the connection for writing) within the limit of
//! being sent means the client made no progress for that long. And the engine
//! may wait for room in the channel for the limit in all, over the whole
//! generation: a client that reads a trickle (one small chunk a minute)
//! completes a write now and then, so no single write or piece waits long, but
//! it paces the engine to its reading, and every wait adds up. Either way the
//! generation is cancelled and its turn goes to the next request; a client
//! that keeps up never makes the engine wait. What lies between the channel
//! and the client (the connection's buffer and the socket's) is bounded by
//! those buffers' sizes, so a client that stops reading holds the turn for
//! about the limit past the moment they fill.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

/// A channel of `capacity` pieces whose pieces must be taken within `limit`
/// of being sent; `runtime` runs the sender's waits.
pub(super) fn channel<T>(capacity: usize, limit: Duration, runtime: tokio::runtime::Handle) -> (Outbox<T>, Inbox<T>) {
    let (tx, rx) = mpsc::channel(capacity);
    let taken = Arc::new(AtomicUsize::new(0));
    let waiting = RefCell::new(VecDeque::new());
    let (sent, stalled) = (Cell::new(0), Cell::new(Duration::ZERO));
    let outbox = Outbox { tx, runtime, limit, taken: taken.clone(), sent, stalled, waiting };
    (outbox, Inbox { rx, taken })
}

/// The engine thread's end (it blocks; never use it on a runtime worker).
pub(super) struct Outbox<T> {
    tx: mpsc::Sender<T>,
    runtime: tokio::runtime::Handle,
    limit: Duration,
    /// Pieces the receiving end has taken.
    taken: Arc<AtomicUsize>,
    /// Pieces sent.
    sent: Cell<usize>,
    /// How long sends have waited for room, in all.
    stalled: Cell<Duration>,
    /// When each piece not yet known to be taken was sent, oldest first.
    waiting: RefCell<VecDeque<Instant>>,
}

impl<T> Outbox<T> {
    /// Sends `piece`, waiting for room no longer than the oldest waiting
    /// piece may wait and the stall allowance lasts; false when the receiver
    /// is gone or has fallen behind.
    pub fn send(&self, piece: T) -> bool {
        if self.behind() {
            return false;
        }
        let sent = match self.tx.try_send(piece) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(piece)) => {
                let started = Instant::now();
                let allowance = started + self.limit.saturating_sub(self.stalled.get());
                let deadline = self.oldest_waiting().map_or(allowance, |sent| allowance.min(sent + self.limit));
                // The timer is made inside the runtime: this thread may have none.
                let sending = self.runtime.block_on(async { tokio::time::timeout_at(deadline, self.tx.send(piece)).await });
                let sent = matches!(sending, Ok(Ok(())));
                self.stalled.set(self.stalled.get() + started.elapsed());
                sent
            }
        };
        if sent {
            self.sent.set(self.sent.get() + 1);
            self.waiting.borrow_mut().push_back(Instant::now());
        }
        sent
    }

    /// Whether the receiver is gone or has fallen behind (see the module's
    /// comment): either way nobody will read what comes next in time.
    pub fn gone(&self) -> bool {
        self.tx.is_closed() || self.behind()
    }

    /// Whether the receiver has fallen behind (see the module's comment).
    pub fn behind(&self) -> bool {
        self.stalled.get() >= self.limit || self.oldest_waiting().is_some_and(|sent| sent.elapsed() >= self.limit)
    }

    /// When the oldest piece not yet taken was sent.
    fn oldest_waiting(&self) -> Option<Instant> {
        let taken = self.taken.load(Ordering::SeqCst);
        let mut waiting = self.waiting.borrow_mut();
        let known_taken = self.sent.get() - waiting.len();
        for _ in known_taken..taken.min(self.sent.get()) {
            waiting.pop_front();
        }
        waiting.front().copied()
    }
}

/// The response's end.
pub(super) struct Inbox<T> {
    rx: mpsc::Receiver<T>,
    taken: Arc<AtomicUsize>,
}

impl<T> Inbox<T> {
    /// The next piece; `None` once the sender is gone and all are taken.
    pub async fn recv(&mut self) -> Option<T> {
        let piece = self.rx.recv().await;
        if piece.is_some() {
            self.taken.fetch_add(1, Ordering::SeqCst);
        }
        piece
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("a runtime")
    }

    #[test]
    fn a_receiver_that_takes_nothing_lets_go_after_the_limit() {
        let runtime = runtime();
        let (outbox, mut inbox) = channel(1, Duration::from_millis(200), runtime.handle().clone());
        let worker = std::thread::spawn(move || {
            let first = outbox.send("read");
            let started = std::time::Instant::now();
            let second = outbox.send("never read");
            (first, second, started.elapsed(), outbox.gone())
        });
        let (first, second, waited, gone) = worker.join().expect("the sending thread");
        assert!(first && !second, "the second piece has no room and nobody reads");
        assert!(waited < Duration::from_secs(5), "waited {waited:?}");
        assert!(gone, "the first piece waited past the limit");
        assert_eq!(runtime.block_on(inbox.recv()), Some("read"));
    }

    /// A receiver that takes a piece every 50 ms never lets a piece wait
    /// 300 ms untaken (four fit in the channel), but paces a sender that
    /// makes one every 5 ms, whose waits add up to the limit.
    #[test]
    fn a_receiver_that_takes_a_trickle_falls_behind_and_is_let_go() {
        let runtime = runtime();
        let (outbox, mut inbox) = channel(4, Duration::from_millis(300), runtime.handle().clone());
        let reader = runtime.spawn(async move {
            while inbox.recv().await.is_some() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        let worker = std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let mut sent = 0;
            while started.elapsed() < Duration::from_secs(10) && !outbox.gone() && outbox.send(sent) {
                sent += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            (sent, started.elapsed())
        });
        let (sent, took) = worker.join().expect("the sending thread");
        assert!(took < Duration::from_secs(2), "a trickling receiver kept the sender for {took:?} ({sent} pieces)");
        runtime.block_on(reader).expect("the reader");
    }

    #[test]
    fn a_receiver_that_keeps_up_is_never_let_go() {
        let runtime = runtime();
        let (outbox, mut inbox) = channel(2, Duration::from_secs(1), runtime.handle().clone());
        let reader = runtime.spawn(async move {
            let mut count = 0;
            while inbox.recv().await.is_some() {
                count += 1;
            }
            count
        });
        let worker = std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let mut sent = 0;
            while started.elapsed() < Duration::from_millis(500) {
                assert!(!outbox.gone() && outbox.send(sent), "piece {sent} was refused though the reader keeps up");
                sent += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            sent
        });
        let sent = worker.join().expect("the sending thread");
        assert_eq!(runtime.block_on(reader).expect("the reader"), sent);
    }
}
