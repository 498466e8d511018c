//! Fleet-unique machine ids leased in a real etcd, with real `snowgate`
//! replicas: distinct ids, no repeated request id across replicas, a killed
//! replica's slot freed after its TTL, refusal while etcd is down and
//! recovery after, no repeated id across a restart onto the same slot,
//! slots with a high-water mark no holder could have written skipped, no
//! id with the old machine id from a replica frozen past its lease, a
//! prompt stop while etcd does not answer, a replica waiting for a free
//! slot that only reads, no repeated id when etcd loses its data (also
//! between replicas of different TTLs), dead,
//! hung and vanishing endpoints among several, large junk among the marks,
//! a stop in the middle of a claim, and etcd out of space.
//!
//! etcd comes from Debian's `etcd-server` package (`.ci/run` installs it);
//! each test starts its own on loopback with a temporary data directory.
//! Where no `etcd` binary exists, these tests fail under CI (`CI` set) and
//! are skipped with a message elsewhere. The restart onto the same slot
//! also needs libfaketime (Debian's `libfaketime`, which `.ci/run`
//! installs too), in the same way.

#[path = "fleet/members.rs"]
mod members;
mod support;

use members::{EtcdProxy, ReadHoldingMember, StallingMember};
use std::collections::HashSet;
use std::net::TcpListener as StdTcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::Client;
use serde_json::Value;
use snowgate_plugin::SnowflakeLayout;
use support::{
    connect_many, get, post_json, raw_exchange_on, raw_post_request, tool_present, Gateway,
    TempDir, STEP,
};
use tokio::io::AsyncWriteExt as _;

/// The lease TTL the tests use: short, so expiry is quick to observe.
const TTL_SECS: u64 = 3;

/// The `etcd` binary, or `None` (and a message) where it is missing.
fn etcd_binary() -> Option<PathBuf> {
    let found = std::env::var_os("SNOWGATE_ETCD_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("PATH")?
                .to_str()?
                .split(':')
                .map(|dir| PathBuf::from(dir).join("etcd"))
                .find(|p| p.is_file())
        });
    let present = found.is_some();
    tool_present(
        present,
        "the etcd binary",
        "apt-get install etcd-server, or set SNOWGATE_ETCD_BIN",
    );
    found
}

/// A free loopback port (bound and released; etcd binds it right after).
fn free_port() -> u16 {
    StdTcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// One etcd server on loopback with its own data directory.
struct Etcd {
    binary: PathBuf,
    /// Flags added to every launch (for example a space quota).
    flags: Vec<String>,
    data: TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl Etcd {
    /// Starts etcd on free ports. A port found free can be taken by
    /// another test's listener before etcd binds it (the tests run in
    /// parallel); etcd then exits at once, and is started on other ports.
    /// Another test's etcd answering on the port is told apart by its
    /// member name.
    async fn start(binary: PathBuf) -> Etcd {
        Etcd::start_with(binary, &[]).await
    }

    /// [`Etcd::start`] with `flags` added to etcd's command line.
    async fn start_with(binary: PathBuf, flags: &[&str]) -> Etcd {
        let mut etcd = Etcd {
            binary,
            flags: flags.iter().map(|f| f.to_string()).collect(),
            data: TempDir::new("etcd"),
            client_port: free_port(),
            peer_port: free_port(),
            child: None,
        };
        for _ in 0..5 {
            if etcd.try_launch().await {
                return etcd;
            }
            etcd.client_port = free_port();
            etcd.peer_port = free_port();
        }
        panic!("etcd exited at once five times, on five pairs of ports");
    }

    fn url(&self) -> String {
        format!("http://{}", self.client_addr())
    }

    /// Where etcd serves clients: `127.0.0.1:<port>`.
    fn client_addr(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Starts etcd again on its ports, with its data directory.
    async fn launch(&mut self) {
        assert!(
            self.try_launch().await,
            "etcd exited at once on {}",
            self.url()
        );
    }

    /// Its member name, its own among the tests' etcds (the data
    /// directory's name), so that an etcd of another test that took its
    /// port is not taken for it.
    fn name(&self) -> String {
        let dir = self.data.path().file_name().expect("a directory name");
        dir.to_string_lossy().into_owned()
    }

    /// Starts etcd and waits until it serves; false if it exited first.
    async fn try_launch(&mut self) -> bool {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let name = self.name();
        let child = Command::new(&self.binary)
            .args(["--name", &name, "--data-dir"])
            .arg(self.data.path().join("data"))
            .args([
                "--listen-client-urls",
                &self.url(),
                "--advertise-client-urls",
                &self.url(),
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("{name}={peer}")])
            .args(&self.flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd starts");
        self.child = Some(child);
        // Ready when a client can write through it, and it is this one.
        let deadline = Instant::now() + STEP;
        loop {
            if let Ok(mut client) = Client::connect([self.url()], None).await {
                let ours = client
                    .member_list()
                    .await
                    .is_ok_and(|list| list.members().iter().any(|m| m.name() == name));
                if ours && client.put("/snowgate-test/ready", "1", None).await.is_ok() {
                    return true;
                }
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() {
                self.child = None;
                return false;
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not become ready at {}",
                self.url()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends etcd `signal` (`STOP`, `CONT`).
    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("etcd is running").id();
        support::send_signal(pid, signal).unwrap_or_else(|e| panic!("kill -{signal} {pid}: {e}"));
    }

    /// Waits (at most a few TTLs) until machine id `id` is free.
    async fn wait_free(&self, id: u32) {
        self.wait_free_within(id, Duration::from_secs(TTL_SECS * 4))
            .await
    }

    /// Waits until slot `id` is free, for at most `bound`.
    async fn wait_free_within(&self, id: u32, bound: Duration) {
        let deadline = Instant::now() + bound;
        while self.claimed().await.contains(&id) {
            assert!(
                Instant::now() < deadline,
                "slot {id} was never freed after its lease ran out"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Restarts etcd empty, as after losing its disk: every lease, slot
    /// and high-water mark is gone.
    async fn wipe(&mut self) {
        self.stop();
        let data = self.data.path().join("data");
        std::fs::remove_dir_all(&data)
            .unwrap_or_else(|e| panic!("removing {}: {e}", data.display()));
        self.launch().await;
    }

    /// Sets slot `id`'s trtllm-v1 high-water mark to `millis`.
    async fn put_mark(&self, id: u32, millis: u64) {
        let key = format!("/snowgate/trtllm-v1/high-water/{id}");
        self.client()
            .await
            .put(key, millis.to_string(), None)
            .await
            .expect("write a mark");
    }

    /// Slot `id`'s trtllm-v1 high-water mark, if it has one.
    async fn mark(&self, id: u32) -> Option<u64> {
        let key = format!("/snowgate/trtllm-v1/high-water/{id}");
        let response = self
            .client()
            .await
            .get(key, None)
            .await
            .expect("read a mark");
        let kv = response.kvs().first()?;
        Some(kv.value_str().expect("text").parse().expect("a number"))
    }

    /// Stops etcd (SIGKILL) and waits until it is gone.
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A client of this etcd.
    async fn client(&self) -> Client {
        Client::connect([self.url()], None)
            .await
            .expect("connect to etcd")
    }

    /// The machine ids currently claimed for trtllm-v1.
    async fn claimed(&self) -> HashSet<u32> {
        let mut client = self.client().await;
        let prefix = "/snowgate/trtllm-v1/slots/";
        let response = client
            .get(
                prefix,
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_keys_only(),
                ),
            )
            .await
            .expect("list slots");
        response
            .kvs()
            .iter()
            .filter_map(|kv| kv.key_str().ok()?.strip_prefix(prefix)?.parse().ok())
            .collect()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A replica leasing its machine id from `etcd`.
async fn replica(etcd: &Etcd, extra: &[&str]) -> Gateway {
    let url = etcd.url();
    let ttl = TTL_SECS.to_string();
    let mut args = vec!["--etcd", url.as_str(), "--machine-id-ttl", ttl.as_str()];
    args.extend_from_slice(extra);
    Gateway::start(&args).await
}

/// Waits until the replica holds a lease; returns its machine id.
async fn leased_id(replica: &Gateway) -> u32 {
    let status = replica
        .wait_status("a machine id lease", STEP, |s| {
            s["lease"]["state"] == "held" && s["machine_id"].is_u64()
        })
        .await;
    status["machine_id"].as_u64().expect("machine_id") as u32
}

/// Waits until the replica's `/status` shows a lease renewal later than
/// `last_renewed` (a `lease.last_renewed` value read before).
async fn wait_renewed_since(replica: &Gateway, last_renewed: &Value, what: &str) {
    replica
        .wait_status(what, STEP, |s| s["lease"]["last_renewed"] != *last_renewed)
        .await;
}

/// Writes `value` under `prefix` + every trtllm-v1 machine id, with
/// `options`: 128 writes per transaction, etcd's default limit.
async fn put_for_every_id(
    client: &mut Client,
    prefix: &str,
    value: &str,
    options: Option<etcd_client::PutOptions>,
) {
    let ids: Vec<u32> = (0..=SnowflakeLayout::TrtllmV1.max_machine_id()).collect();
    for chunk in ids.chunks(128) {
        let puts = chunk
            .iter()
            .map(|id| etcd_client::TxnOp::put(format!("{prefix}{id}"), value, options.clone()))
            .collect::<Vec<_>>();
        client
            .txn(etcd_client::Txn::new().and_then(puts))
            .await
            .unwrap_or_else(|e| panic!("writing {prefix}* for every machine id: {e}"));
    }
}

/// A batch of `n` context-only requests in one body.
fn batch(n: usize) -> String {
    let one = r#"{"prompt":"x","disaggregated_params":{"request_type":"context_only"}}"#;
    format!("[{}]", vec![one; n].join(","))
}

/// The ids stamped into a batch that went through the echo upstream.
fn batch_ids(echo: &Value) -> Vec<u64> {
    echo["body"]
        .as_array()
        .expect("the echoed body is the batch")
        .iter()
        .map(|r| {
            r["disaggregated_params"]["disagg_request_id"]
                .as_u64()
                .expect("stamped")
        })
        .collect()
}

/// Sends `requests` batches of `per_batch` to `replica`; returns the ids.
async fn stamp_many(replica: &Gateway, requests: usize, per_batch: usize) -> Vec<u64> {
    let body = batch(per_batch);
    let mut ids = Vec::with_capacity(requests * per_batch);
    for _ in 0..requests {
        let reply = post_json(replica.addr, "/v1/completions", body.clone()).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        ids.extend(batch_ids(&reply.json()));
    }
    ids
}

/// Every one of `ids` is a trtllm-v1 id of machine id `machine`.
fn assert_issued_by(ids: &[u64], machine: u32) {
    for &id in ids {
        let parts = SnowflakeLayout::TrtllmV1
            .decode(id)
            .expect("a trtllm-v1 id");
        assert_eq!(parts.machine_id, machine, "id {id}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn replicas_started_at_once_get_distinct_ids_and_never_share_a_request_id() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let (a, b, c) = tokio::join!(
        replica(&etcd, &[]),
        replica(&etcd, &[]),
        replica(&etcd, &[])
    );
    let replicas = [a, b, c];
    let mut machine_ids = HashSet::new();
    for r in &replicas {
        assert!(
            machine_ids.insert(leased_id(r).await),
            "two replicas hold the same machine id"
        );
    }
    assert_eq!(
        machine_ids,
        HashSet::from([0, 1, 2]),
        "the lowest free ids are claimed"
    );
    assert_eq!(etcd.claimed().await, machine_ids);

    // At least 100,000 ids from all replicas under concurrent load.
    let (x, y, z) = tokio::join!(
        stamp_many(&replicas[0], 12, 3000),
        stamp_many(&replicas[1], 12, 3000),
        stamp_many(&replicas[2], 12, 3000)
    );
    let mut seen = HashSet::new();
    for (ids, r) in [(x, &replicas[0]), (y, &replicas[1]), (z, &replicas[2])] {
        let machine = r.status().await["machine_id"]
            .as_u64()
            .expect("still leased") as u32;
        assert_issued_by(&ids, machine);
        for id in ids {
            assert!(seen.insert(id), "id {id} issued twice");
        }
    }
    assert!(seen.len() >= 100_000, "{} ids", seen.len());
    let metrics = replicas[0].metrics().await;
    assert!(
        metrics.contains("snowgate_lease_acquisitions_total 1\n"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_replicas_slot_is_free_after_the_ttl_and_a_stopped_ones_at_once() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    // A lease long enough that the second replica's start, seconds in a
    // debug build on a busy machine, ends well inside it: once the lease
    // runs out, the second could rightly take slot 0.
    const FIRST_TTL: Duration = Duration::from_secs(20);
    let first_ttl = FIRST_TTL.as_secs().to_string();
    let url = etcd.url();
    // Before the lease is granted, so before its last renewal.
    let started = Instant::now();
    let first = Gateway::start(&["--etcd", &url, "--machine-id-ttl", &first_ttl]).await;
    assert_eq!(leased_id(&first).await, 0);

    first.signal("KILL");
    first.wait_exit(STEP).await;
    let killed_at = Instant::now();
    // The lease outlives the process until its TTL: slot 0 stays claimed,
    // and a new replica must not take it meanwhile.
    assert!(
        etcd.claimed().await.contains(&0),
        "slot 0 was freed when its holder was killed, before its TTL"
    );
    let second = replica(&etcd, &[]).await;
    // Its claim comes long before its lease is in use (it waits out a
    // never-held slot's floor): seen in etcd beside slot 0's, the claim was
    // made while slot 0's lease could still be alive.
    let deadline = Instant::now() + STEP;
    let claims = loop {
        let claims = etcd.claimed().await;
        if claims.len() > 1 || !claims.contains(&0) {
            break claims;
        }
        assert!(
            killed_at.elapsed() < FIRST_TTL,
            "the second replica started too slowly to show anything: slot 0's lease ran out \
             first ({:?} after the kill); claimed: {claims:?}",
            killed_at.elapsed()
        );
        assert!(
            Instant::now() < deadline,
            "the second replica claimed no slot; claimed: {claims:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        claims,
        HashSet::from([0, 1]),
        "the second replica's claim, {:?} after the kill (the killed one's TTL is {FIRST_TTL:?})",
        killed_at.elapsed()
    );
    assert_eq!(leased_id(&second).await, 1);
    etcd.wait_free_within(0, FIRST_TTL * 2).await;
    // Not before a TTL from its last renewal, which came after `started`
    // (the kill itself, the reap and a look at /status come after that
    // renewal, and may take more than a margin on a busy machine).
    assert!(
        started.elapsed() >= FIRST_TTL - Duration::from_millis(500),
        "slot 0 was freed {:?} after its holder started, before its TTL of {FIRST_TTL:?}",
        started.elapsed()
    );
    let third = replica(&etcd, &[]).await;
    assert_eq!(
        leased_id(&third).await,
        0,
        "the freed slot is the lowest and is taken again"
    );

    // A clean stop revokes the lease: the slot is free at once.
    third.stop().await;
    assert!(
        !etcd.claimed().await.contains(&0),
        "SIGTERM did not revoke the lease"
    );
}

/// etcd down past the TTL: the replica refuses to stamp, and once etcd is
/// back with its data (which extends every lease by its TTL when it elects
/// a leader), it finds its lease alive and stamps with the same id and
/// lease at once, after every id it issued before, instead of claiming a
/// new slot and waiting for that slot's floor.
#[tokio::test(flavor = "multi_thread")]
async fn replicas_refuse_to_stamp_while_etcd_is_down_and_resume_their_id_after() {
    let Some(binary) = etcd_binary() else { return };
    let mut etcd = Etcd::start(binary).await;
    let r = replica(&etcd, &[]).await;
    let id = leased_id(&r).await;
    let lease = r.status().await["lease"]["lease_id"].clone();
    let context_only = r#"{"prompt":"x","disaggregated_params":{"request_type":"context_only"}}"#;
    assert_eq!(
        post_json(r.addr, "/v1/completions", context_only)
            .await
            .status,
        200
    );
    let before = stamp_many(&r, 3, 1000).await;

    etcd.stop();
    let stopped = Instant::now();
    r.wait_status(
        "the lease to be lost",
        Duration::from_secs(TTL_SECS * 4),
        |s| s["lease"]["state"] == "lost",
    )
    .await;
    // The lease was last renewed before etcd stopped, so it may expire a
    // TTL after `stopped`. A request sent from then on must be refused,
    // however late the replica's keeper noticed (on a loaded machine it may
    // notice after the TTL; the request path checks the deadline itself).
    // Timing the status instead would measure the test's polling too.
    tokio::time::sleep_until((stopped + Duration::from_secs(TTL_SECS)).into()).await;
    let refused = post_json(r.addr, "/v1/completions", context_only).await;
    assert_eq!(
        refused.status,
        503,
        "stamped past the TTL: {}",
        refused.text()
    );
    assert!(
        refused.text().contains("lease"),
        "the 503 says why: {}",
        refused.text()
    );
    let passes = post_json(r.addr, "/v1/completions", r#"{"prompt":"no params"}"#).await;
    assert_eq!(passes.status, 200, "requests that need no id still pass");
    let metrics = r.metrics().await;
    assert!(metrics.contains("snowgate_lease_losses_total 1\n"));
    assert_eq!(support::metric(&metrics, "snowgate_lease_held"), 0.0);

    etcd.launch().await;
    let status = r
        .wait_status("the lease to be held again", STEP, |s| {
            s["lease"]["state"] == "held"
        })
        .await;
    assert_eq!(status["machine_id"], id, "the same id: {status}");
    assert_eq!(
        status["lease"]["lease_id"], lease,
        "the same lease: {status}"
    );
    assert_eq!(status["lease"]["resumptions"], 1, "{status}");
    assert_eq!(status["lease"]["acquisitions"], 1, "no new claim: {status}");
    let metrics = r.metrics().await;
    assert_eq!(
        support::metric(&metrics, "snowgate_lease_resumptions_total"),
        1.0
    );
    assert_eq!(support::metric(&metrics, "snowgate_lease_held"), 1.0);
    r.wait_log("stamping resumed with the same id").await;
    let after = stamp_many(&r, 3, 1000).await;
    assert_issued_by(&after, id);
    let last_before = before.iter().max().copied().expect("ids before");
    assert!(
        after.iter().all(|&new| new > last_before),
        "an id after the outage is not after every id before it"
    );
    // The slot is still bound to the resumed lease: a second replica takes
    // another.
    let other = replica(&etcd, &[]).await;
    assert_ne!(leased_id(&other).await, id);
}

/// How far the restarted replica's wall clock steps back, by libfaketime
/// (its `FAKETIME` offset): less than the id clock's 9 s lead, so that the
/// replica stamps at once right after the mark; more than a debug build
/// takes to stop one replica and start the next on a busy machine, so that
/// the new wall clock is behind the ids issued before the restart.
const STEP_BACK_AFTER_A_STOP: &str = "-7s";

/// The environment that moves a replica's wall clock (`CLOCK_REALTIME`) by
/// `offset` (libfaketime's `-7s`). Its monotonic and boot clocks, which
/// time its lease, are left alone; etcd times the lease on its own clock.
fn faked_clock(library: &std::path::Path, offset: &str) -> Vec<(&'static str, String)> {
    vec![
        ("LD_PRELOAD", library.display().to_string()),
        ("FAKETIME", offset.to_string()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()),
    ]
}

/// A clean stop writes the last id's millisecond as the slot's mark; the
/// replica restarted onto the slot starts after it. Its wall clock has
/// stepped back 7 s meanwhile (as after an NTP step), behind the ids issued
/// before the restart, so only the mark keeps its ids after them: with the
/// real clock, the restart's own time would.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_restarted_onto_the_same_slot_repeats_no_id() {
    let Some(binary) = etcd_binary() else { return };
    let Some(library) = support::faketime() else {
        return;
    };
    let etcd = Etcd::start(binary).await;
    let before = replica(&etcd, &[]).await;
    let id = leased_id(&before).await;
    // Bursts of 4,000 ids per request run the clock ahead of the wall clock.
    let first_ids = stamp_many(&before, 10, 4000).await;
    before.stop().await;
    let millis = |id: u64| SnowflakeLayout::TrtllmV1.decode(id).expect("an id").millis;
    let max_before = first_ids.iter().max().copied().expect("ids");
    let last = millis(max_before);
    let mark = etcd.mark(id).await.expect("a mark after the clean stop");
    assert!(
        mark >= last,
        "the mark after a clean stop, {mark}, is before the last id's millisecond {last}"
    );
    assert_eq!(
        mark, last,
        "a clean stop writes the last id's millisecond as the mark"
    );

    let env = faked_clock(&library, STEP_BACK_AFTER_A_STOP);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let url = etcd.url();
    let ttl = TTL_SECS.to_string();
    let after = Gateway::start_with_env(&["--etcd", &url, "--machine-id-ttl", &ttl], &env).await;
    assert_eq!(
        leased_id(&after).await,
        id,
        "the restarted replica takes the same slot"
    );
    let second_ids = stamp_many(&after, 3, 4000).await;
    assert_issued_by(&second_ids, id);
    let earlier: HashSet<u64> = first_ids.iter().copied().collect();
    for &new in &second_ids {
        assert!(
            !earlier.contains(&new),
            "id {new} was issued before the restart too"
        );
        assert!(
            new > max_before,
            "id {new} (ms {}) is not after the last id before the restart (ms {last})",
            millis(new)
        );
    }
    // The step back is real: the first id is right after the mark, where
    // the id clock was set, not at the replica's wall clock, which would be
    // later had it not stepped back behind the mark.
    let first_after = millis(second_ids.iter().min().copied().expect("ids"));
    assert_eq!(
        first_after,
        mark + 1,
        "the restarted replica's first id is not right after the mark: its wall clock was not \
         behind it (libfaketime not in effect, or the restart took longer than the step back, \
         {STEP_BACK_AFTER_A_STOP})"
    );
}

/// A replica moved off etcd to a fixed `--machine-id` of the id it leased
/// (as the README's config file lets an operator do) starts its id clock
/// at its wall clock: the leased run's stop waits for the wall clock to
/// pass its last id, as a stop with a high-water file does for a rollback.
/// Before, the leased stop gave its slot back and exited at once, up to
/// the id clock's 9 s lead ahead (a claim's floor, bursts of ids), and the
/// fixed run repeated thousands of its ids.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_moved_from_etcd_to_a_fixed_id_repeats_no_id() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let leased = replica(&etcd, &[]).await;
    let id = leased_id(&leased).await;
    // Bursts of 4,000 ids per request run the clock ahead of the wall clock.
    let leased_ids = stamp_many(&leased, 10, 4000).await;
    let millis = |id: u64| SnowflakeLayout::TrtllmV1.decode(id).expect("an id").millis;
    let last = leased_ids.iter().copied().map(millis).max().expect("ids");
    assert!(
        last > now_millis(),
        "the leased run's last id (ms {last}) is not ahead of the wall clock, so this test \
         would pass without the stop's wait"
    );
    leased.stop().await;
    let after_stop = now_millis();
    assert!(
        after_stop > last,
        "the leased replica exited at ms {after_stop}, before the wall clock passed its last id \
         (ms {last})"
    );

    let machine_id = id.to_string();
    let fixed = Gateway::start(&["--machine-id", &machine_id]).await;
    let fixed_ids = stamp_many(&fixed, 3, 4000).await;
    assert_issued_by(&fixed_ids, id);
    let earlier: HashSet<u64> = leased_ids.iter().copied().collect();
    for new in fixed_ids {
        assert!(
            !earlier.contains(&new),
            "id {new} was issued by the leased run too"
        );
    }
}

/// A high-water mark no holder could have written (not a number, or more
/// than a day past the furthest a holder sets it) leaves the slot's earlier
/// ids unknown: the replica skips that slot, says why, and takes the next
/// one.
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_whose_high_water_mark_is_unreadable_is_skipped() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let mut client = etcd.client().await;
    let year_ahead = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64
        + 365 * 86_400_000;
    client
        .put("/snowgate/trtllm-v1/high-water/0", "soon", None)
        .await
        .expect("writing a bad mark");
    client
        .put(
            "/snowgate/trtllm-v1/high-water/1",
            year_ahead.to_string(),
            None,
        )
        .await
        .expect("writing a far mark");

    let replica = replica(&etcd, &[]).await;
    assert_eq!(leased_id(&replica).await, 2);
    assert_eq!(etcd.claimed().await, HashSet::from([2]));
    replica
        .wait_log(r#"the high-water mark /snowgate/trtllm-v1/high-water/0 holds "soon""#)
        .await;
    replica
        .wait_log("the high-water mark /snowgate/trtllm-v1/high-water/1 is ")
        .await;
    replica
        .wait_log("more than a day past the furthest a holder sets it")
        .await;
    assert_issued_by(&stamp_many(&replica, 1, 10).await, 2);
}

/// With a bad mark on every slot, the replica stamps nothing and says why
/// in `/status`; once an operator deletes one mark, it takes that slot.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_with_only_bad_slots_says_so_and_recovers_when_one_is_fixed() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let mut client = etcd.client().await;
    let max = SnowflakeLayout::TrtllmV1.max_machine_id();
    put_for_every_id(&mut client, "/snowgate/trtllm-v1/high-water/", "soon", None).await;

    let replica = replica(&etcd, &[]).await;
    let status = replica
        .wait_status("the claim to fail", STEP, |s| {
            s["lease"]["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("skipped for a bad high-water mark"))
        })
        .await;
    let error = status["lease"]["last_error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&format!(
            "no machine id of layout trtllm-v1 (0..={max}) is free: 0 taken, and {} skipped",
            max + 1
        )),
        "{error}"
    );
    assert!(error.contains("ids 0, 1, 2, 3, 4, 5, 6, 7 and"), "{error}");
    // Slots whose mark is bad are skipped without being claimed.
    assert!(etcd.claimed().await.is_empty());
    let reply = post_json(replica.addr, "/v1/completions", batch(1)).await;
    assert_eq!(reply.status, 503, "{}", reply.text());

    client
        .delete("/snowgate/trtllm-v1/high-water/5", None)
        .await
        .expect("deleting one mark");
    assert_eq!(leased_id(&replica).await, 5);
    assert_issued_by(&stamp_many(&replica, 1, 3).await, 5);
}

/// etcd's count of leases granted since it started.
async fn leases_granted(etcd: &Etcd) -> f64 {
    let reply = support::get(([127, 0, 0, 1], etcd.client_port).into(), "/metrics").await;
    assert_eq!(reply.status, 200, "etcd's /metrics: {}", reply.text());
    support::metric(reply.text(), "etcd_debugging_lease_granted_total")
}

/// With every slot held by others, a waiting replica says so once as a
/// warning (then at debug level), and only reads: no lease is granted and
/// revoked at every retry. It claims a slot as soon as one frees.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_waiting_for_a_free_slot_warns_once_and_grants_no_lease() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let mut client = etcd.client().await;
    let holder = client
        .lease_grant(600, None)
        .await
        .expect("the other replicas' lease")
        .id();
    let max = SnowflakeLayout::TrtllmV1.max_machine_id();
    let leased = etcd_client::PutOptions::new().with_lease(holder);
    put_for_every_id(
        &mut client,
        "/snowgate/trtllm-v1/slots/",
        "another-replica",
        Some(leased),
    )
    .await;
    let granted = leases_granted(&etcd).await;

    let replica = Gateway::start_logging(
        &[
            "--etcd",
            &etcd.url(),
            "--machine-id-ttl",
            &TTL_SECS.to_string(),
        ],
        "info,snowgate_host::lease=debug",
    )
    .await;
    replica
        .wait_log_times("claiming a machine id in etcd failed again", 3)
        .await;
    let log = replica.stderr_text();
    assert!(!log.contains("no --machine-id given"), "{log}");
    let warned = log
        .lines()
        .filter(|line| {
            line.contains("WARN") && line.contains("claiming a machine id in etcd failed")
        })
        .collect::<Vec<_>>();
    assert_eq!(warned.len(), 1, "{log}");
    assert!(
        warned[0].contains(&format!(
            "every machine id of layout trtllm-v1 (0..={max}) is taken"
        )),
        "{}",
        warned[0]
    );
    assert_eq!(
        leases_granted(&etcd).await,
        granted,
        "the waiting replica granted leases in etcd"
    );
    let reply = post_json(replica.addr, "/v1/completions", batch(1)).await;
    assert_eq!(reply.status, 503, "{}", reply.text());
    // Readiness and `/status` say why, not only that a lease is being
    // acquired (which no request to etcd was doing).
    let taken = format!("every machine id of layout trtllm-v1 (0..={max}) is taken");
    let ready = get(replica.admin, "/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.text());
    assert!(ready.text().contains(&taken), "{}", ready.text());
    let status = replica.status().await;
    let why = status["machine_id_error"].as_str().unwrap_or_default();
    assert!(why.contains(&taken), "{status}");

    // The other replicas go: the waiting one takes the lowest slot, under
    // a lease of its own (which the count sees, so it counts this replica).
    client.lease_revoke(holder).await.expect("revoking");
    assert_eq!(leased_id(&replica).await, 0);
    assert_eq!(leases_granted(&etcd).await, granted + 1.0);
    assert_issued_by(&stamp_many(&replica, 1, 3).await, 0);
}

/// A replica frozen for longer than its lease (a stalled VM, a stopped
/// container) wakes up to find its slot may belong to another replica.
/// Requests that reached it while it was frozen are read the moment it
/// wakes, before its lease keeper has noticed anything: none of them may
/// leave with an id of the old machine id, which the new holder is issuing.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_frozen_past_its_lease_lets_out_no_id_of_its_old_machine_id() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let frozen = replica(&etcd, &[]).await;
    assert_eq!(leased_id(&frozen).await, 0);
    let mut waiting = connect_many(frozen.addr, 16).await;

    frozen.signal("STOP");
    etcd.wait_free(0).await;
    let successor = replica(&etcd, &[]).await;
    assert_eq!(leased_id(&successor).await, 0, "the successor takes slot 0");

    let request = raw_post_request(
        "/v1/completions",
        b"Content-Type: application/json\r\n",
        batch(50).as_bytes(),
    );
    for stream in &mut waiting {
        stream.write_all(&request).await.expect("write a request");
    }
    frozen.signal("CONT");
    let replies = waiting
        .into_iter()
        .map(|stream| tokio::spawn(async move { raw_exchange_on(stream, b"").await }))
        .collect::<Vec<_>>();
    let successor_ids = stamp_many(&successor, 20, 500).await;
    assert_issued_by(&successor_ids, 0);

    let mut refused = 0;
    for reply in replies {
        let reply = reply.await.expect("the exchange ran");
        match reply.status {
            503 => {
                assert_eq!(reply.json()["error"]["code"], "no_machine_id", "{reply:?}");
                refused += 1;
            }
            200 => {
                // Stamped after the frozen replica claimed a new slot.
                let ids = batch_ids(&reply.json());
                for id in &ids {
                    let parts = SnowflakeLayout::TrtllmV1.decode(*id).expect("an id");
                    assert_ne!(
                        parts.machine_id, 0,
                        "id {id} carries machine id 0, which the successor holds"
                    );
                    assert!(!successor_ids.contains(id), "id {id} issued twice");
                }
            }
            other => panic!("unexpected status {other}: {reply:?}"),
        }
    }
    eprintln!("{refused} of 16 requests refused while the lease was lost");
    assert_eq!(
        leased_id(&successor).await,
        0,
        "the successor kept its slot"
    );
    // The frozen replica's keeper asked etcd about its old lease first,
    // found it gone, and claimed another slot.
    frozen.wait_log("is gone; claiming a machine id anew").await;
    assert_ne!(leased_id(&frozen).await, 0);
    assert_eq!(frozen.status().await["lease"]["resumptions"], 0);
}

/// A replica told to stop while etcd does not answer stops promptly: it
/// waits a second each for its last mark and the revocation, not for etcd
/// (its lease then runs out after the TTL).
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_stops_promptly_while_etcd_does_not_answer() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let url = etcd.url();
    // Slot 0 was held before, to the last second: a slot without a mark
    // would be waited for a TTL (see the etcd-lost test below).
    etcd.put_mark(0, now_millis() - 1000).await;
    // A long TTL: the lease is still held when the stop comes.
    let r = Gateway::start(&["--etcd", url.as_str(), "--machine-id-ttl", "60"]).await;
    assert_eq!(leased_id(&r).await, 0);
    etcd.signal("STOP");
    r.signal("TERM");
    let status = r.wait_exit(Duration::from_secs(10)).await;
    etcd.signal("CONT");
    assert!(status.success(), "{}", r.stderr_text());
    assert!(
        r.stderr_text().contains("etcd did not answer within 1 s"),
        "{}",
        r.stderr_text()
    );
}

/// etcd restarted empty (its disk lost) forgets every lease and mark, but a
/// replica that held a slot does not know yet and may go on stamping until
/// its next renewal, at most until its lease deadline. Its id clock is never
/// more than 9 s (`MAX_LEAD`) ahead of its wall clock. So a new holder of a
/// slot with no mark must start past the old holder's wall clock plus 9 s,
/// as of when the old holder must stop.
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_whose_mark_etcd_lost_is_taken_over_past_every_id_its_holder_could_issue() {
    let Some(binary) = etcd_binary() else { return };
    let mut etcd = Etcd::start(binary).await;
    let old = replica(&etcd, &[]).await;
    assert_eq!(leased_id(&old).await, 0);
    let old_ids = stamp_many(&old, 2, 1000).await;
    // Frozen, the old holder issues nothing later than this, plus 9 s.
    old.signal("STOP");
    let frozen_at = now_millis();
    etcd.wipe().await;

    let new = replica(&etcd, &[]).await;
    // It holds the slot, and waits a TTL and a second before its first id:
    // not ready meanwhile.
    let waiting = get(new.admin, "/readyz").await;
    assert_eq!(waiting.status, 503, "{}", waiting.text());
    assert!(
        waiting.text().starts_with("not ready: "),
        "{}",
        waiting.text()
    );
    assert_eq!(leased_id(&new).await, 0, "the new replica takes slot 0");
    let ready = get(new.admin, "/readyz").await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    let new_ids = stamp_many(&new, 2, 1000).await;
    for id in &new_ids {
        let millis = SnowflakeLayout::TrtllmV1.decode(*id).expect("an id").millis;
        assert!(
            millis > frozen_at + 9_000,
            "id {id} (ms {millis}) is within 9 s of the old holder's clock when it stopped \
             ({frozen_at}): it may repeat one of the old holder's"
        );
        assert!(!old_ids.contains(id), "id {id} issued twice");
    }
    old.signal("CONT");
}

/// Milliseconds since the Unix epoch, by this host's clock.
fn now_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64
}

/// A replica whose lease etcd lost with its data stops stamping at its next
/// renewal, when etcd answers that the lease is unknown, rather than only
/// at its deadline: another replica may hold its slot by then.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_whose_lease_etcd_lost_stops_at_its_next_renewal() {
    let Some(binary) = etcd_binary() else { return };
    let mut etcd = Etcd::start(binary).await;
    let url = etcd.url();
    // A long TTL: the deadline (9 s after the last renewal) is well after
    // the next renewal (every 3.3 s) that reaches the restarted etcd.
    let r = Gateway::start(&["--etcd", url.as_str(), "--machine-id-ttl", "10"]).await;
    assert_eq!(leased_id(&r).await, 0);
    etcd.wipe().await;
    r.wait_log("machine id lease lost").await;
    let log = r.stderr_text();
    assert!(
        log.contains("etcd no longer knows the lease"),
        "the lease was lost for another reason, or late: {log}"
    );
    // It claims again, and stamps.
    let status = r
        .wait_status("the lease to be held again", STEP, |s| {
            s["lease"]["state"] == "held"
        })
        .await;
    assert!(status["machine_id"].is_u64());
    let reply = post_json(r.addr, "/v1/completions", batch(1)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// An etcd endpoint that refuses connections and one that accepts them but
/// never answers (a hung member), listed next to a live one in any order:
/// the replica leases an id, keeps it through renewals, and stamps.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_leases_and_keeps_an_id_while_other_etcd_endpoints_are_down() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let live = etcd.url();
    // Port 1: privileged, so no test listens there (a port found free
    // could become another test's etcd).
    let refused = "http://127.0.0.1:1".to_string();
    // Bound but never accepted: the kernel completes the handshake, and
    // nothing ever answers.
    let hung_member = StdTcpListener::bind("127.0.0.1:0").expect("bind");
    let hung = format!("http://{}", hung_member.local_addr().expect("address"));
    for endpoints in [
        [&refused, &hung, &live],
        [&live, &refused, &hung],
        [&hung, &live, &refused],
    ] {
        let endpoints = endpoints.map(String::as_str).join(",");
        // The hung member costs each renewal that tries it half the time
        // between renewals: a longer TTL than the shortest, so that a
        // loaded machine still renews with time to spare (with the
        // shortest, one run on a saturated machine saw etcd's answer come
        // after the lease's deadline).
        let ttl = (2 * TTL_SECS).to_string();
        let r = Gateway::start(&["--etcd", &endpoints, "--machine-id-ttl", &ttl]).await;
        assert_eq!(leased_id(&r).await, 0, "with {endpoints}");
        // A TTL of renewals (three), stamping all along.
        let until = Instant::now() + Duration::from_secs(2 * TTL_SECS);
        let mut stamped = 0;
        while Instant::now() < until {
            let reply = post_json(r.addr, "/v1/completions", batch(10)).await;
            assert_eq!(reply.status, 200, "with {endpoints}: {}", reply.text());
            stamped += 1;
        }
        assert!(stamped > 0);
        let metrics = r.metrics().await;
        assert!(
            metrics.contains("snowgate_lease_losses_total 0\n"),
            "with {endpoints}: the lease was lost\n{metrics}"
        );
        // A clean stop frees the slot (and leaves its exact mark) for the
        // next round.
        r.stop().await;
    }
}

/// How the etcd member a replica talks to fails while the replica holds
/// its id.
#[derive(Debug, Clone, Copy)]
enum MemberFailure {
    /// Its connections are cut and new ones refused.
    GoesAway,
    /// Its connections stay open and nothing is answered.
    Hangs,
}

/// The etcd member a replica talks to fails while it holds its id: the
/// replica renews through another endpoint and keeps its id.
async fn keeps_its_id_when_its_etcd_member(failure: MemberFailure) {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let mut member = EtcdProxy::start(&etcd.client_addr()).await;
    // The proxy first, so that the replica connects through it.
    let endpoints = format!("{},{}", member.url, etcd.url());
    // A hung member costs half the time between renewals before the next
    // is tried: a longer TTL than the shortest, so that a loaded machine
    // still renews with seconds to spare.
    let ttl_secs = match failure {
        MemberFailure::GoesAway => TTL_SECS,
        MemberFailure::Hangs => 2 * TTL_SECS,
    };
    let ttl = ttl_secs.to_string();
    let r = Gateway::start(&["--etcd", &endpoints, "--machine-id-ttl", &ttl]).await;
    assert_eq!(leased_id(&r).await, 0);
    let held = r.status().await;
    let before = held["lease"]["lease_id"].clone();
    // Once a renewal went through the member, its keep-alive stream is open.
    wait_renewed_since(&r, &held["lease"]["last_renewed"], "a renewal").await;
    match failure {
        MemberFailure::GoesAway => member.take_down(),
        MemberFailure::Hangs => member.hang(),
    }
    // Two TTLs of renewals after the member failed, stamping all along.
    let until = Instant::now() + Duration::from_secs(2 * ttl_secs);
    while Instant::now() < until {
        let reply = post_json(r.addr, "/v1/completions", batch(10)).await;
        assert_eq!(reply.status, 200, "{failure:?}: {}", reply.text());
    }
    // A renewal or a mark write through the member failed (whichever came
    // first), and the replica went on through the other.
    r.wait_log_until("a move to the other member", |log| {
        log.contains("renewing the lease failed") || log.contains("moving to another member")
    })
    .await;
    let status = r.status().await;
    assert_eq!(
        status["lease"]["lease_id"], before,
        "{failure:?}: the same lease: {status}"
    );
    assert_eq!(status["machine_id"], 0, "{status}");
    let metrics = r.metrics().await;
    assert!(
        metrics.contains("snowgate_lease_losses_total 0\n"),
        "{failure:?}: the lease was lost\n{metrics}\n{}",
        r.stderr_text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replica_keeps_its_id_when_its_etcd_member_goes_away() {
    keeps_its_id_when_its_etcd_member(MemberFailure::GoesAway).await;
}

/// A hung member is the harder case: a call on it waits for its timeout,
/// so the renewal must not be retried there before another is tried.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_keeps_its_id_when_its_etcd_member_hangs() {
    keeps_its_id_when_its_etcd_member(MemberFailure::Hangs).await;
}

/// Sends batches of 10 context-only requests to `replica` for `how_long`;
/// each must be stamped. `what` names the situation in a failure.
async fn stamps_throughout(replica: &Gateway, how_long: Duration, what: &str) {
    let until = Instant::now() + how_long;
    while Instant::now() < until {
        let reply = post_json(replica.addr, "/v1/completions", batch(10)).await;
        assert_eq!(
            reply.status,
            200,
            "{what}: {}\n{}",
            reply.text(),
            replica.stderr_text()
        );
    }
}

/// The member a replica talks to answers renewals but not reads or writes
/// (its disk stalled): renewals alone would keep the replica there, and
/// ids would stop at the slot's mark within a few seconds. A mark write
/// that goes unanswered moves the replica to another member, through
/// which the mark is raised, and stamping goes on with the same lease.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_moves_off_a_member_that_renews_but_does_not_write() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let member = StallingMember::start(&etcd.client_addr()).await;
    let endpoints = format!("{},{}", member.url, etcd.url());
    let ttl = TTL_SECS.to_string();
    let r = Gateway::start(&["--etcd", &endpoints, "--machine-id-ttl", &ttl]).await;
    assert_eq!(leased_id(&r).await, 0);
    let held = r.status().await;
    wait_renewed_since(&r, &held["lease"]["last_renewed"], "a renewal").await;
    member.stall();
    // The mark leads the ids by the TTL and a second: three leads.
    let lead = Duration::from_secs(TTL_SECS + 1);
    stamps_throughout(&r, 3 * lead, "behind a member whose disk stalled").await;
    r.wait_log("moving to another member").await;
    let status = r.status().await;
    assert_eq!(
        status["lease"]["lease_id"], held["lease"]["lease_id"],
        "{status}"
    );
    assert_eq!(status["machine_id"], 0, "{status}");
    assert_eq!(status["lease"]["losses"], 0, "{status}");
    member.thaw();
}

/// With a long TTL, a hung member costs seconds, not a third of the TTL:
/// a hung first endpoint delays the first claim by a call's wait (and is
/// named in the log), and a member that hangs while the replica holds its
/// id is left within seconds, long before ids reach the slot's mark.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_with_a_long_ttl_waits_seconds_not_a_third_of_it_on_a_hung_member() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let first = EtcdProxy::start(&etcd.client_addr()).await;
    let second = EtcdProxy::start(&etcd.client_addr()).await;
    first.hang();
    let endpoints = format!("{},{},{}", first.url, second.url, etcd.url());
    // 40 s a call before: the first claim would not come within `STEP`.
    let r = Gateway::start(&["--etcd", &endpoints, "--machine-id-ttl", "120"]).await;
    assert_eq!(leased_id(&r).await, 0);
    r.wait_log(&format!(
        "etcd endpoints did not answer; using {}",
        second.url
    ))
    .await;
    assert!(
        r.stderr_text().contains(&first.url),
        "the log names the hung endpoint:\n{}",
        r.stderr_text()
    );
    let held = r.status().await;
    second.hang();
    // The mark leads the ids by 11 s whatever the TTL: two leads.
    stamps_throughout(&r, Duration::from_secs(22), "behind a hung member").await;
    let status = r.status().await;
    assert_eq!(
        status["lease"]["lease_id"], held["lease"]["lease_id"],
        "{status}"
    );
    assert_eq!(status["lease"]["losses"], 0, "{status}");
    first.resume();
    second.resume();
}

/// Large values under the high-water prefix (three of 1.4 MB: together
/// over the client's 4 MiB message limit) do not stop claims: each claimed
/// slot's mark is read on its own.
#[tokio::test(flavor = "multi_thread")]
async fn large_junk_under_the_high_water_prefix_does_not_stop_claims() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let mut client = etcd.client().await;
    let junk = "x".repeat(1_400_000);
    for id in [1000, 1001, 1002] {
        client
            .put(
                format!("/snowgate/trtllm-v1/high-water/{id}"),
                junk.as_str(),
                None,
            )
            .await
            .expect("write a large value");
    }
    let r = replica(&etcd, &[]).await;
    assert_eq!(leased_id(&r).await, 0);
    let reply = post_json(r.addr, "/v1/completions", batch(3)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    r.wait_log("reading every high-water mark at once failed")
        .await;
}

/// A replica stopped while its claim is under way (here: holding a slot
/// with no mark, waiting a TTL before its first id) revokes the lease it
/// was granted, so the slot is free at once, not after the TTL.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_stopped_during_its_claim_frees_the_slot_at_once() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let r = replica(&etcd, &[]).await;
    let deadline = Instant::now() + STEP;
    while !etcd.claimed().await.contains(&0) {
        assert!(Instant::now() < deadline, "slot 0 was never claimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(r.status().await["lease"]["state"], "acquiring");
    r.stop().await;
    assert!(
        !etcd.claimed().await.contains(&0),
        "slot 0 is still claimed after the replica stopped"
    );
}

/// A mark further ahead of this host's clock than any takeover waits for
/// (here a minute: this host's clock behind the fleet's, or a mark set by
/// hand) is skipped like a bad one, rather than held while the clock
/// catches up.
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_whose_mark_is_a_minute_ahead_is_skipped_not_waited_for() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    etcd.put_mark(0, now_millis() + 60_000).await;
    let r = replica(&etcd, &[]).await;
    assert_eq!(leased_id(&r).await, 1, "slot 0 is skipped");
    r.wait_log("ahead of this host's clock").await;
    let reply = post_json(r.addr, "/v1/completions", batch(3)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// A replica that loses its lease while it waits for a slot's floor never
/// used that slot: its id clock must not be left at that floor. Here the
/// first claim waits for a mark 20 s ahead; meanwhile the mark is put back
/// a second into the past and the lease is revoked; the replica claims
/// again, has nothing to wait for, and stamps at once, at its wall clock.
/// A clock left at the first floor would be 20 s ahead, past the 9 s it may
/// lead: every request would be refused (503 `id_rate_exceeded`). (With the
/// mark deleted instead, the new claim's floor, a slot without a mark's,
/// would lie past the first one, and hide a clock left there.)
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_abandoned_while_waiting_leaves_the_id_clock_alone() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let first_floor = now_millis() + 20_000;
    etcd.put_mark(0, first_floor).await;
    let mut client = etcd.client().await;
    let r = replica(&etcd, &[]).await;
    r.wait_status("the wait for the mark", STEP, |s| {
        s["lease"]["last_error"]
            .as_str()
            .is_some_and(|e| e.starts_with("holding machine id 0, waiting"))
    })
    .await;
    let slot = client
        .get("/snowgate/trtllm-v1/slots/0", None)
        .await
        .expect("read the slot");
    let lease = slot.kvs().first().expect("slot 0 is claimed").lease();
    // The mark first: the claim under way does not read it again (it
    // writes it only once its wait is over, about 11 s after the first
    // mark was put), the next one reads this.
    etcd.put_mark(0, now_millis() - 1000).await;
    client.lease_revoke(lease).await.expect("revoke the lease");

    assert_eq!(leased_id(&r).await, 0, "slot 0 claimed again");
    let status = r.status().await;
    assert_ne!(
        status["lease"]["lease_id"], lease,
        "held under the revoked lease: {status}"
    );
    let reply = post_json(r.addr, "/v1/completions", batch(3)).await;
    assert_eq!(
        reply.status,
        200,
        "the id clock was left at the abandoned claim's floor? {}",
        reply.text()
    );
    let id = batch_ids(&reply.json())[0];
    let millis = SnowflakeLayout::TrtllmV1.decode(id).expect("an id").millis;
    assert!(
        millis <= now_millis() + 9_000,
        "id {id} is more than 9 s ahead"
    );
}

/// Posts batches of 10 to `replica` until `until`; the ids of the batches
/// that were stamped (others, refused while no id could be issued, are
/// left out).
async fn stamp_until(replica: &Gateway, until: Instant) -> Vec<u64> {
    let mut ids = Vec::new();
    while Instant::now() < until {
        let reply = post_json(replica.addr, "/v1/completions", batch(10)).await;
        if reply.status == 200 {
            ids.extend(batch_ids(&reply.json()));
        }
    }
    ids
}

/// etcd restarted empty under a replica with a long TTL (60 s, so 20 s
/// between renewals), with a replica with the shortest TTL started right
/// after: that one takes the slot with no mark and stamps from 10 + 1 + 9
/// + 1 s ahead, 12.2 s later; the long-TTL holder must not go on stamping until
/// its next renewal, when its clock reaches those ids. It notices when the
/// restart breaks its keep-alive stream.
#[tokio::test(flavor = "multi_thread")]
async fn replicas_with_different_ttls_repeat_no_id_when_etcd_loses_its_data() {
    let Some(binary) = etcd_binary() else { return };
    let mut etcd = Etcd::start(binary).await;
    etcd.put_mark(0, now_millis() - 1000).await;
    let url = etcd.url();
    let long = Gateway::start(&["--etcd", url.as_str(), "--machine-id-ttl", "60"]).await;
    assert_eq!(leased_id(&long).await, 0);
    etcd.wipe().await;
    let short = replica(&etcd, &[]).await;
    // Past the new replica's floor, before the long one's next renewal.
    let until = Instant::now() + Duration::from_secs(18);
    let (long_ids, short_ids) = tokio::join!(stamp_until(&long, until), stamp_until(&short, until));
    assert!(!short_ids.is_empty(), "the new replica never stamped");
    let long_ids: HashSet<u64> = long_ids.into_iter().collect();
    let repeated: Vec<u64> = short_ids
        .into_iter()
        .filter(|id| long_ids.contains(id))
        .collect();
    assert!(
        repeated.is_empty(),
        "{} ids issued by both, e.g. {:?}",
        repeated.len(),
        &repeated[..repeated.len().min(3)]
    );
    long.wait_log("etcd no longer knows the lease").await;
}

/// As above, but the long-TTL holder's link to etcd goes silent (a
/// partition) just as etcd loses its data, so no broken stream tells it;
/// a replica with the shortest TTL then takes the slot. The old
/// holder stamps on, not knowing, until the mark etcd last confirmed to it,
/// and marks are never further ahead than 10 s and a second, whatever the
/// TTL: the new holder starts past that, not past its own TTL, so the two
/// share no id (with marks a TTL ahead, a review measured 12,941 shared
/// ids with these TTLs).
#[tokio::test(flavor = "multi_thread")]
async fn replicas_with_different_ttls_share_no_id_when_etcd_loses_its_data_behind_a_silent_link() {
    let Some(binary) = etcd_binary() else { return };
    let mut etcd = Etcd::start(binary).await;
    etcd.put_mark(0, now_millis() - 1000).await;
    let link = EtcdProxy::start(&etcd.client_addr()).await;
    let old = Gateway::start(&["--etcd", &link.url, "--machine-id-ttl", "30"]).await;
    assert_eq!(leased_id(&old).await, 0);
    link.hang();
    etcd.wipe().await;

    // The old holder stamps until it refuses, while the new one starts.
    let old_stamps = async {
        let body = batch(100);
        let mut ids = Vec::new();
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let reply = post_json(old.addr, "/v1/completions", body.clone()).await;
            if reply.status != 200 {
                assert_eq!(reply.status, 503, "{}", reply.text());
                return ids;
            }
            ids.extend(batch_ids(&reply.json()));
            assert!(
                Instant::now() < until,
                "the old holder stamped for 60 s without reaching etcd"
            );
        }
    };
    let new_stamps = async {
        let new = replica(&etcd, &[]).await;
        assert_eq!(leased_id(&new).await, 0, "the new replica takes slot 0");
        stamp_many(&new, 2, 1000).await
    };
    let (old_ids, new_ids) = tokio::join!(old_stamps, new_stamps);
    assert!(
        !old_ids.is_empty(),
        "the old holder stamped nothing after the wipe"
    );
    let old_ids: HashSet<u64> = old_ids.into_iter().collect();
    let millis = |id: u64| SnowflakeLayout::TrtllmV1.decode(id).expect("an id").millis;
    let old_last = old_ids.iter().map(|&id| millis(id)).max().expect("ids");
    let shared = new_ids.iter().filter(|id| old_ids.contains(id)).count();
    assert_eq!(shared, 0, "{shared} ids issued by both holders");
    for &id in &new_ids {
        assert!(
            millis(id) > old_last,
            "id {id} (ms {}) is not past the old holder's last id (ms {old_last})",
            millis(id)
        );
    }
    link.resume();
}

/// A replica with a TTL longer than 10 s renews less often than its
/// high-water mark's lead (10 s and a second) runs out, so it raises the
/// mark between renewals on its own: a request after a quiet spell longer
/// than the lead is stamped, not refused at the mark.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_with_a_long_ttl_keeps_its_mark_ahead_through_a_quiet_spell() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    etcd.put_mark(0, now_millis() - 1000).await;
    let url = etcd.url();
    // 20 s between renewals.
    let r = Gateway::start(&["--etcd", url.as_str(), "--machine-id-ttl", "60"]).await;
    assert_eq!(leased_id(&r).await, 0);
    let leased_at = Instant::now();
    stamp_many(&r, 1, 10).await;
    // The quiet spell is what is tested: past the claim's mark (11 s after
    // it), before the first renewal.
    tokio::time::sleep_until((leased_at + Duration::from_secs(13)).into()).await;
    let reply = post_json(r.addr, "/v1/completions", batch(10)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// A mark someone else raised while a replica holds the slot (an operator
/// moving a fixed id's history into etcd) is kept, not lowered by the
/// holder's next raise nor by its clean stop's exact mark: the slot's next
/// holder starts after it. The holder's own ids go on past it too, since
/// ids with its machine id may have gone up to it (before, they went on
/// below it until the holder stopped).
#[tokio::test(flavor = "multi_thread")]
async fn a_mark_someone_else_raised_is_not_lowered_by_its_holder() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    let r = replica(&etcd, &[]).await;
    assert_eq!(leased_id(&r).await, 0);
    stamp_many(&r, 1, 10).await;
    // Ahead of the holder's mark.
    let raised = etcd.mark(0).await.expect("the holder's mark") + 3_000;
    etcd.put_mark(0, raised).await;
    // Said at the holder's next raise (a third of its TTL on), which then
    // writes its own mark past it.
    r.wait_log("someone else wrote it: it is kept").await;
    let deadline = Instant::now() + STEP;
    while etcd.mark(0).await <= Some(raised) {
        assert!(Instant::now() < deadline, "{}", r.stderr_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Ids stop (503) until the wall clock is within the id clock's lead of
    // the kept mark, some seconds.
    while post_json(r.addr, "/v1/completions", batch(1)).await.status != 200 {
        assert!(Instant::now() < deadline, "{}", r.stderr_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let more = stamp_many(&r, 1, 10).await;
    assert_issued_by(&more, 0);
    for id in &more {
        let millis = SnowflakeLayout::TrtllmV1.decode(*id).expect("an id").millis;
        assert!(
            millis > raised,
            "an id at {millis}, not past the kept mark {raised}"
        );
    }
    r.stop().await;
    assert!(
        etcd.mark(0).await >= Some(raised),
        "lowered by the holder: {}",
        r.stderr_text()
    );
}

/// The high-water mark changes under its holder between the holder's read
/// and its write (as when etcd took a write of the holder's own but its
/// answer never came; a holder writes only over the mark it read, so that
/// a write reaching etcd late cannot undo a later one): the holder's write
/// is refused, and it reads the mark again and writes over it, keeps its
/// id, and stamps on. The change is put between the two for certain: the
/// holder reaches etcd through a proxy that holds etcd's answer to its read
/// back until the change is in.
#[tokio::test(flavor = "multi_thread")]
async fn a_mark_changed_under_its_holder_is_written_over_and_stamping_goes_on() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    etcd.put_mark(0, now_millis() - 1000).await;
    let member = ReadHoldingMember::start(&etcd.client_addr()).await;
    // A TTL of 6 s: the holder renews every 2 s and raises its mark right
    // after, with up to a member's answer wait (2 s) for each call; the
    // answer is held back for far less.
    let r = Gateway::start(&["--etcd", &member.url, "--machine-id-ttl", "6"]).await;
    assert_eq!(leased_id(&r).await, 0);
    let mut ids = stamp_many(&r, 1, 10).await;
    // Connected before, so that the change lands as soon as it is sent.
    let mut client = etcd.client().await;
    // A lower mark in the holder's place, once etcd has served the read of
    // the holder's next write (a raise, after its next renewal).
    member.hold_next_read();
    member.wait_held(STEP).await;
    let lowered = now_millis() - 1000;
    client
        .put(
            "/snowgate/trtllm-v1/high-water/0",
            lowered.to_string(),
            None,
        )
        .await
        .expect("write a mark");
    member.release();
    // The write that follows the read compares the mark's revision with
    // the one read, which the change moved on: etcd refuses it. The holder
    // reads again and writes again, in the same raise.
    let calls = member.calls_after_release(3, STEP).await;
    assert_eq!(
        calls,
        ["Txn", "Range", "Txn"],
        "after the mark changed between its read and its write, the holder did not write, read \
         again and write again\n{}",
        r.stderr_text()
    );
    let deadline = Instant::now() + STEP;
    loop {
        if etcd.mark(0).await.is_some_and(|mark| mark > lowered) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the holder never wrote over the changed mark ({:?})\n{}",
            etcd.mark(0).await,
            r.stderr_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ids.extend(stamp_many(&r, 3, 100).await);
    let mark = etcd.mark(0).await.expect("a mark");
    for &id in &ids {
        let millis = SnowflakeLayout::TrtllmV1.decode(id).expect("an id").millis;
        assert!(
            millis <= mark,
            "id {id} (ms {millis}) is past the mark {mark}"
        );
    }
    let log = r.stderr_text();
    assert!(
        !log.contains("raising the high-water mark failed"),
        "a raise failed: the write over the changed mark was not made in the raise that met \
         it\n{log}"
    );
    let metrics = r.metrics().await;
    assert!(
        metrics.contains("snowgate_lease_losses_total 0\n"),
        "the lease was lost\n{metrics}"
    );
}

/// A replica stopped while the etcd member it talks to hangs records its
/// last mark and revokes its lease through another member: the slot is
/// free at once, and a replica restarted at once takes it again.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_stopped_while_its_member_hangs_frees_its_slot_through_another() {
    let Some(binary) = etcd_binary() else { return };
    let etcd = Etcd::start(binary).await;
    etcd.put_mark(0, now_millis() - 1000).await;
    let member = EtcdProxy::start(&etcd.client_addr()).await;
    let endpoints = format!("{},{}", member.url, etcd.url());
    let ttl = TTL_SECS.to_string();
    let r = Gateway::start(&["--etcd", &endpoints, "--machine-id-ttl", &ttl]).await;
    assert_eq!(leased_id(&r).await, 0);
    let reply = post_json(r.addr, "/v1/completions", batch(3)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    member.hang();
    r.stop().await;
    assert!(
        !etcd.claimed().await.contains(&0),
        "slot 0 is still claimed after a clean stop\n{}",
        r.stderr_text()
    );
}

/// A member that answers nothing for most of a TTL and then comes back: a
/// renewal goes unanswered and so do the reopens, then the member answers
/// again. The replica keeps its lease, and still notices at once when etcd
/// later goes away, rather than at its next renewal (a renewal on the
/// stream that failed used to read the answer queued for an earlier one,
/// and left the stream unwatched).
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_still_notices_etcd_going_away_after_a_slow_spell() {
    let Some(binary) = etcd_binary() else { return };
    let mut etcd = Etcd::start(binary).await;
    etcd.put_mark(0, now_millis() - 1000).await;
    let member = EtcdProxy::start(&etcd.client_addr()).await;
    // 30 s: renewals every 10 s, each waited for 2 s (a call's wait, at
    // most), then reopens every half second after a call's wait each, until
    // the deadline 29 s after the last renewal.
    let r = Gateway::start(&["--etcd", &member.url, "--machine-id-ttl", "30"]).await;
    assert_eq!(leased_id(&r).await, 0);
    let held = r.status().await;
    wait_renewed_since(&r, &held["lease"]["last_renewed"], "a renewal").await;
    let renewed = Instant::now();
    // The member is silent for 20 s: the next renewal (at 10 s) and the
    // reopens after it go unanswered; the deadline is at 29 s, 9 s on,
    // room for a busy machine.
    member.hang();
    r.wait_log("renewing the lease failed").await;
    tokio::time::sleep_until((renewed + Duration::from_secs(20)).into()).await;
    let before = r.status().await["lease"]["last_renewed"].clone();
    member.resume();
    wait_renewed_since(&r, &before, "a renewal after the slow spell").await;
    assert!(
        r.metrics()
            .await
            .contains("snowgate_lease_losses_total 0\n"),
        "{}",
        r.stderr_text()
    );

    etcd.stop();
    let stopped = Instant::now();
    // At once, not at the next renewal, some 10 s on.
    while r.stderr_text().matches("renewing the lease failed").count() < 2 {
        assert!(
            stopped.elapsed() < Duration::from_secs(7),
            "etcd going away was not noticed within 7 s:\n{}",
            r.stderr_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `/readyz` (every 20 ms, at most `bound`) until it answers
/// `status`; returns that reply.
async fn wait_readiness(replica: &Gateway, status: u16, bound: Duration) -> support::Reply {
    let deadline = Instant::now() + bound;
    loop {
        let reply = get(replica.admin, "/readyz").await;
        if reply.status == status {
            // The gauge an alert reads says so too.
            let ready = if status == 200 { 1.0 } else { 0.0 };
            replica.wait_metric("snowgate_ready", ready).await;
            return reply;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz did not answer {status} within {bound:?}; last: {} {}\nstderr:\n{}",
            reply.status,
            reply.text(),
            replica.stderr_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// etcd out of space (its NOSPACE alarm) refuses every write, so the
/// replica cannot raise its slot's high-water mark; its lease lives on,
/// as renewals are not writes. Its ids run into the old mark: requests get
/// 503 and `/readyz` says not ready, naming the mark, instead of ids
/// leaving past a mark etcd never stored. Once an operator frees space
/// (delete, compact, defragment, disarm the alarm), both recover.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_whose_etcd_is_out_of_space_is_not_ready_until_space_is_freed() {
    let Some(binary) = etcd_binary() else { return };
    // 1 MiB: a few large values fill it.
    let etcd = Etcd::start_with(binary, &["--quota-backend-bytes", "1048576"]).await;
    etcd.put_mark(0, now_millis() - 1000).await;
    let r = replica(&etcd, &[]).await;
    assert_eq!(leased_id(&r).await, 0);
    wait_readiness(&r, 200, STEP).await;
    let before = post_json(r.addr, "/v1/completions", batch(3)).await;
    assert_eq!(before.status, 200, "{}", before.text());

    let mut client = etcd.client().await;
    let junk = "x".repeat(300_000);
    // etcd checks the quota against its database file, which grows when
    // its batch commits (every 100 ms): some writes past the quota land.
    let mut written = 0;
    let deadline = Instant::now() + STEP;
    let full = loop {
        match client
            .put(format!("/junk/{written}"), junk.as_str(), None)
            .await
        {
            Ok(_) => written += 1,
            Err(e) => break e.to_string(),
        }
        assert!(
            Instant::now() < deadline,
            "etcd still took writes after {written} of 300 kB under a 1 MiB quota"
        );
    };
    assert!(full.contains("database space exceeded"), "{full}");

    // The mark is TTL + 1 s ahead: within that, ids reach it.
    let not_ready = wait_readiness(&r, 503, Duration::from_secs(TTL_SECS + 1) + STEP).await;
    assert!(
        not_ready.text().contains("high-water mark"),
        "{}",
        not_ready.text()
    );
    let refused = post_json(r.addr, "/v1/completions", batch(3)).await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(
        refused.text().contains("high-water mark"),
        "{}",
        refused.text()
    );
    r.wait_log("database space exceeded").await;
    assert_eq!(r.status().await["lease"]["state"], "held");

    // The operator's remedy, as `etcdctl` does it.
    let deleted = client
        .delete(
            "/junk/",
            Some(etcd_client::DeleteOptions::new().with_prefix()),
        )
        .await
        .expect("delete the junk");
    let revision = deleted.header().expect("a header").revision();
    client.compact(revision, None).await.expect("compact");
    client.defragment().await.expect("defragment");
    let alarms = client
        .alarm(
            etcd_client::AlarmAction::Get,
            etcd_client::AlarmType::None,
            None,
        )
        .await
        .expect("list alarms");
    for alarm in alarms.alarms() {
        let mut options = etcd_client::AlarmOptions::new();
        options.with_member(alarm.member_id());
        client
            .alarm(
                etcd_client::AlarmAction::Deactivate,
                alarm.alarm(),
                Some(options),
            )
            .await
            .expect("disarm the alarm");
    }

    // The next renewal raises the mark again.
    wait_readiness(&r, 200, STEP).await;
    let after = post_json(r.addr, "/v1/completions", batch(3)).await;
    assert_eq!(after.status, 200, "{}", after.text());
    assert_issued_by(&batch_ids(&after.json()), 0);
}
