//! The threads that serve client connections: one single-threaded event
//! loop per thread, like nginx's worker processes. A connection, its plugin
//! calls and its upstream connections all stay on the thread it was given
//! to, so a request is never handed between threads.

use std::future::Future;
use std::thread::JoinHandle;

use anyhow::Context as _;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// A fixed set of worker threads, each driving its own current-thread
/// runtime until the set is stopped or dropped.
pub struct Workers {
    workers: Vec<Worker>,
}

struct Worker {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Workers {
    /// Starts `count` worker threads (at least one), named
    /// `snowgate-worker-N`.
    pub fn start(count: usize) -> anyhow::Result<Workers> {
        let workers = (0..count.max(1))
            .map(Worker::start)
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Workers { workers })
    }

    /// How many workers there are.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether there are none (never: `start` makes at least one).
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Runs `task` on worker `index` (modulo the count).
    pub fn spawn<F>(&self, index: usize, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let worker = &self.workers[index % self.workers.len()];
        drop(worker.handle.spawn(task));
    }

    /// Stops every worker, dropping the tasks still on it, and waits for
    /// the threads to end.
    pub fn stop(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        for worker in &mut self.workers {
            if let Some(stop) = worker.stop.take() {
                let _ = stop.send(());
            }
        }
        for worker in &mut self.workers {
            if let Some(thread) = worker.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop_all();
    }
}

impl Worker {
    fn start(index: usize) -> anyhow::Result<Worker> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting a worker's event loop")?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("snowgate-worker-{index}"))
            .spawn(move || {
                // Runs the spawned connection tasks until told to stop;
                // dropping the runtime then cancels whatever is left.
                let _ = runtime.block_on(stopped);
                runtime.shutdown_background();
            })
            .context("starting a worker thread")?;
        Ok(Worker {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}
