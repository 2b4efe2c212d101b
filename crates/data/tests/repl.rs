//! Scripted tests of the replication core (`nacre_data::repl`), in the spirit of etcd-raft's
//! data-driven tests: one thread, no runtime, no clock. A script is a list of commands; each is
//! followed by the lines the core must answer with (`> …`), all of them and in order. A command
//! is an event for the partition's [`Replication`], a query of its state, or a call of one of the
//! per-extent rules. Each test names the design section it checks: CFS §2.3 (primary-backup
//! replication) as docs/ARCHITECTURE.md describes it ("Replication is scenario-aware",
//! "Committed lengths", "Failures").
//!
//! Commands (extents by number; lists comma-separated, `-` for none):
//! - `elected term=T followers=N,… local=E:LEN,… known=E:COMMITTED,…`
//! - `listed align=T|recheck=ID from=N extents=E:LEN:COMMITTED,…`
//! - `unreachable align=T|recheck=ID from=N why=TEXT`
//! - `settle term=T released=E,… busy=E,…|?` (`?`: the shell cannot tell)
//! - `replication-failed why=TEXT`, `write-refused why=TEXT`
//! - `recheck followers=N,… committed=E:C,… [next=E:N,…] local=E:LEN,…`
//! - `extent-refused extent=E why=TEXT`, `deposed term=T newer=N`
//! - `store-failed leading=BOOL followers=N,…`, `store-reopened`
//! - `state`: `> aligned=T|- degraded=TEXT|-`
//! - `lagging`: `> lagging=E,…|-`; `superseded term=T`: `> superseded=N|-`
//! - `check-term sent=S known=K`
//! - `follower-take have=H committed=C offset=O [tiny]`
//! - `plan-batch next=N max=M waiting=OFFSET:LEN,…`
//! - `track-from-disk len=L leading=BOOL`
//! - `tiny-offset next=N committed=C held=H align=A`
//! - `repair have=H committed=C suspect=BOOL block=B`

use std::collections::{BTreeSet, HashMap};

use nacre_data::repl::extent::{
    Take, check_term, follower_take, plan_batch, tiny_offset, track_from_disk,
};
use nacre_data::repl::{
    Action, Event, RepairStep, Replication, Round, TransferReason, repair_steps,
};
use nacre_types::ExtentId;

/// Runs `script` against a fresh replica (a node that just started: nothing aligned, no
/// committed offset known).
fn run(script: &str) {
    let mut r = Replication::new();
    let mut lines = script.lines().map(str::trim).enumerate().peekable();
    while let Some((n, line)) = lines.next() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        assert!(
            !line.starts_with('>'),
            "line {}: an expectation without a command: {line}",
            n + 1
        );
        let got = command(&mut r, line);
        let mut want = Vec::new();
        while let Some((_, l)) = lines.peek() {
            match l.strip_prefix('>') {
                Some(w) => want.push(w.trim().to_string()),
                None if l.is_empty() || l.starts_with('#') => {}
                None => break,
            }
            lines.next();
        }
        assert_eq!(
            got,
            want,
            "line {}: `{line}`\n got:\n{}\n want:\n{}",
            n + 1,
            got.join("\n"),
            want.join("\n")
        );
    }
}

/// Performs one command; returns what it answered, one line each.
fn command(r: &mut Replication, line: &str) -> Vec<String> {
    let (cmd, rest) = line.split_once(' ').unwrap_or((line, ""));
    let args = Args::parse(rest);
    let event = match cmd {
        "elected" => Event::Elected {
            term: args.num("term"),
            followers: args.nums("followers"),
            local: args.pairs("local"),
            known: args.pairs("known"),
        },
        "listed" => Event::Listed {
            round: args.round(),
            from: args.num("from"),
            extents: args
                .list("extents")
                .iter()
                .map(|t| {
                    let v: Vec<u64> = t.split(':').map(num).collect();
                    (ExtentId(v[0]), v[1], v[2])
                })
                .collect(),
        },
        "unreachable" => Event::Unreachable {
            round: args.round(),
            from: args.num("from"),
            why: args.text("why"),
        },
        "settle" => Event::Settle {
            term: args.num("term"),
            released: args.extents("released").into_iter().collect(),
            busy: (args.get("busy") != "?")
                .then(|| args.extents("busy").into_iter().collect::<BTreeSet<_>>()),
        },
        "replication-failed" => Event::ReplicationFailed {
            why: args.text("why"),
        },
        "write-refused" => Event::LocalWriteRefused {
            why: args.text("why"),
        },
        "recheck" => Event::Recheck {
            followers: args.nums("followers"),
            committed: args.pairs("committed"),
            next: args.pairs("next"),
            local: args.pairs("local"),
        },
        "extent-refused" => Event::ExtentRefused {
            extent: ExtentId(args.num("extent")),
            why: args.text("why"),
        },
        "deposed" => Event::Deposed {
            term: args.num("term"),
            newer: args.num("newer"),
        },
        "lagging" => {
            return vec![format!(
                "lagging={}",
                join(r.lagging_extents().iter().map(|e| e.0))
            )];
        }
        "superseded" => {
            let newer = r.superseded(args.num("term"));
            return vec![format!(
                "superseded={}",
                newer.map_or("-".to_string(), |n| n.to_string())
            )];
        }
        "check-term" => {
            return vec![match check_term(args.num("sent"), args.num("known")) {
                Ok(()) => "take".to_string(),
                Err(e) => format!("refused: {e}"),
            }];
        }
        "store-failed" => Event::StoreFailed {
            leading: args.get("leading") == "true",
            followers: args.nums("followers"),
        },
        "store-reopened" => Event::StoreReopened,
        "state" => {
            let aligned = (0..100)
                .find(|t| r.aligned(*t))
                .map_or("-".to_string(), |t| t.to_string());
            return vec![format!(
                "aligned={aligned} degraded={}",
                r.degraded().unwrap_or("-")
            )];
        }
        "follower-take" => {
            let tiny = rest.split_whitespace().any(|w| w == "tiny");
            let out = follower_take(
                args.num("have"),
                args.num("committed"),
                args.num("offset"),
                tiny,
            );
            return vec![match out {
                Ok(Take::Write) => "write".to_string(),
                Ok(Take::CutThenWrite) => "cut-then-write".to_string(),
                Err(e) => format!("refused: {e}"),
            }];
        }
        "plan-batch" => {
            let waiting: Vec<(u64, usize)> = args
                .pairs("waiting")
                .into_iter()
                .map(|(o, l)| (o.0, l as usize))
                .collect();
            let b = plan_batch(args.num("next"), waiting, args.num("max") as usize);
            return vec![format!(
                "stale={} take={}",
                join(b.stale.iter()),
                join(b.take.iter())
            )];
        }
        "tiny-offset" => {
            let at = tiny_offset(
                args.num("next"),
                args.num("committed"),
                args.num("held"),
                args.num("align"),
            );
            return vec![format!("offset={at}")];
        }
        "track-from-disk" => {
            let (next, committed) = track_from_disk(args.num("len"), args.get("leading") == "true");
            return vec![format!("next={next} committed={committed}")];
        }
        "repair" => {
            let steps = repair_steps(
                args.num("have"),
                args.num("committed"),
                args.get("suspect") == "true",
                args.num("block"),
            );
            return steps
                .into_iter()
                .map(|s| match s {
                    RepairStep::Compare { upto } => format!("compare upto={upto}"),
                    RepairStep::Copy { first, count } => {
                        format!("copy first={first} count={count}")
                    }
                })
                .collect();
        }
        other => panic!("unknown command `{other}`"),
    };
    r.step(event);
    r.ready().iter().map(render).collect()
}

fn render(a: &Action) -> String {
    let round = |r: &Round| match r {
        Round::Align { term } => format!("align={term}"),
        Round::Recheck { id } => format!("recheck={id}"),
    };
    match a {
        Action::ListExtents { round: r, follower } => format!("list {} to={follower}", round(r)),
        Action::Settle { term, extents } => format!(
            "settle term={term} extents={}",
            join(extents.iter().map(|e| e.0))
        ),
        Action::Track {
            extent,
            committed,
            len,
            cut,
        } => format!(
            "track {} committed={committed} len={len}{}",
            extent.0,
            if *cut { " cut" } else { "" }
        ),
        Action::Degrade { reason } => format!("degrade: {reason}"),
        Action::Aligned { term } => format!("aligned term={term}"),
        Action::TransferLeader { to, why } => format!(
            "transfer to={to} {}",
            match why {
                TransferReason::LacksCommitted => "lacks-committed",
                TransferReason::StoreFailed => "store-failed",
            }
        ),
        Action::Writable { was } => format!("writable was: {was}"),
        Action::StillReadOnly { why } => format!("still-read-only: {why}"),
        Action::Reopen => "reopen".to_string(),
        Action::Lags { extent, why } => format!("lags {}: {why}", extent.0),
        Action::CaughtUp { extents } => format!("caught-up {}", join(extents.iter().map(|e| e.0))),
        Action::Superseded { term, newer } => format!("superseded term={term} newer={newer}"),
    }
}

fn join<T: ToString>(v: impl Iterator<Item = T>) -> String {
    let v: Vec<String> = v.map(|x| x.to_string()).collect();
    if v.is_empty() {
        "-".into()
    } else {
        v.join(",")
    }
}

fn num(s: &str) -> u64 {
    s.parse()
        .unwrap_or_else(|_| panic!("`{s}` is not a number"))
}

/// A command's `key=value` arguments; `why=` takes the rest of the line.
struct Args(HashMap<String, String>);

impl Args {
    fn parse(rest: &str) -> Self {
        let mut m = HashMap::new();
        let (head, why) = match rest.split_once("why=") {
            Some((h, w)) => (h, Some(w)),
            None => (rest, None),
        };
        for w in head.split_whitespace() {
            if let Some((k, v)) = w.split_once('=') {
                m.insert(k.to_string(), v.to_string());
            }
        }
        if let Some(w) = why {
            m.insert("why".to_string(), w.to_string());
        }
        Self(m)
    }

    fn get(&self, k: &str) -> &str {
        self.0
            .get(k)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("missing `{k}=`"))
    }

    fn text(&self, k: &str) -> String {
        self.get(k).to_string()
    }

    fn num(&self, k: &str) -> u64 {
        num(self.get(k))
    }

    fn list(&self, k: &str) -> Vec<String> {
        match self.0.get(k).map(String::as_str) {
            None | Some("-") | Some("") => Vec::new(),
            Some(v) => v.split(',').map(str::to_string).collect(),
        }
    }

    fn nums(&self, k: &str) -> Vec<u64> {
        self.list(k).iter().map(|s| num(s)).collect()
    }

    fn extents(&self, k: &str) -> Vec<ExtentId> {
        self.nums(k).into_iter().map(ExtentId).collect()
    }

    fn pairs(&self, k: &str) -> Vec<(ExtentId, u64)> {
        self.list(k)
            .iter()
            .map(|t| {
                let (e, l) = t
                    .split_once(':')
                    .unwrap_or_else(|| panic!("`{t}` is not EXTENT:LENGTH"));
                (ExtentId(num(e)), num(l))
            })
            .collect()
    }

    fn round(&self) -> Round {
        match (self.0.get("align"), self.0.get("recheck")) {
            (Some(t), _) => Round::Align { term: num(t) },
            (None, Some(id)) => Round::Recheck { id: num(id) },
            (None, None) => panic!("missing `align=` or `recheck=`"),
        }
    }
}

/// "Committed lengths": a new leader asks each follower in turn, then takes per extent the
/// largest committed offset any replica knew, or else the shortest copy — here the shortest copy
/// (8500) is above what anyone knew committed (8000). The leader's bytes past it are an
/// unacknowledged tail: cut. A follower behind the committed offset could not take the extent's
/// next packet, so the extent lags (takes no appends) while the follower repairs it from the
/// leader block by block; the partition stays writable. A follower with a stale tail past the
/// committed offset cuts it when the next packet arrives there.
#[test]
fn committed_lengths_a_follower_behind_is_brought_up_and_stale_tails_are_cut() {
    run("
        elected term=2 followers=2,3 local=1024:9000,1025:100 known=-
        > list align=2 to=2
        listed align=2 from=2 extents=1024:8500:8000,1025:100:100
        > list align=2 to=3
        listed align=2 from=3 extents=1024:9000:8000,1025:40:0
        > settle term=2 extents=1024,1025
        # Extent 1025: node 3 lacks committed bytes node 2 knew of (100 > 40): the leader keeps
        # them, node 3 repairs, and the extent takes no appends meanwhile.
        settle term=2 released=- busy=-
        > track 1024 committed=8500 len=9000 cut
        > track 1025 committed=100 len=100
        > lags 1025: a follower's copy is short at the leader change
        > aligned term=2
        state
        > aligned=2 degraded=-
        lagging
        > lagging=1025

        # Node 3 takes the next packet of 1024 at the committed offset: its tail goes.
        follower-take have=9000 committed=8500 offset=8500
        > cut-then-write
        # Never below what is committed.
        follower-take have=9000 committed=8500 offset=8000
        > refused: batch at 8000 starts below the committed offset 8500
        # A packet of 1025 past node 3's end (one the leader sent before it knew) is refused:
        # the extent lags (it does already), and the partition stays writable.
        follower-take have=40 committed=100 offset=100
        > refused: batch at 100 starts past this replica's 40 bytes
        extent-refused extent=1025 why=node-3: out of range
        state
        > aligned=2 degraded=-

        # A re-check while node 3 still lacks bytes: 1025 keeps lagging.
        recheck followers=2,3 committed=1024:8500,1025:100 local=1024:8500,1025:100
        > list recheck=1 to=2
        listed recheck=1 from=2 extents=1024:8500:8500,1025:100:100
        > list recheck=1 to=3
        listed recheck=1 from=3 extents=1024:8500:8500,1025:40:0

        # Node 3 repairs 1025 (32-byte blocks here): the blocks from the one holding byte 40.
        repair have=40 committed=100 suspect=false block=32
        > copy first=1 count=3
        repair have=0 committed=1000 suspect=false block=32
        > copy first=0 count=8
        > copy first=8 count=8
        > copy first=16 count=8
        > copy first=24 count=8
        # Nothing lacking and nothing suspect: nothing to do.
        repair have=100 committed=100 suspect=false block=32

        recheck followers=2,3 committed=1024:8500,1025:100 local=1024:8500,1025:100
        > list recheck=2 to=2
        listed recheck=2 from=2 extents=1024:8500:8500,1025:100:100
        > list recheck=2 to=3
        listed recheck=2 from=3 extents=1024:8500:8500,1025:100:100
        > caught-up 1025
        lagging
        > lagging=-
    ");
}

/// "Failures" with a restart: a follower killed mid-append degrades the partition; while it is
/// down, re-checks keep it read-only. Once it answers again the partition is writable at once,
/// for new extents and for every extent whose bytes the follower holds. The extents its copy is
/// too short for lag: a tiny extent until it holds the committed bytes (tiny writes go past
/// every copy's end, so only committed bytes count), a normal one until it holds the bytes up to
/// where the next append starts — here never in this term, since the failed packet's bytes were
/// never committed and repair copies only committed ones; its writer has moved to a new extent.
/// A refusal that arrives while a re-check runs keeps its extent lagging whatever the listings
/// (taken earlier) say.
#[test]
fn failures_a_restarted_follower_makes_only_the_extents_it_lacks_lag_while_it_repairs() {
    run("
        elected term=3 followers=2,3 local=1024:8192,1025:4096,5:8192 known=-
        > list align=3 to=2
        listed align=3 from=2 extents=1024:8192:8192,1025:4096:4096,5:8192:8192
        > list align=3 to=3
        listed align=3 from=3 extents=1024:8192:8192,1025:4096:4096,5:8192:8192
        > settle term=3 extents=5,1024,1025
        settle term=3 released=- busy=-
        > track 5 committed=8192 len=8192
        > track 1024 committed=8192 len=8192
        > track 1025 committed=4096 len=4096
        > aligned term=3

        # Node 3 is killed; a packet of 1025 (written here and on node 2) fails on it.
        replication-failed why=replication failed: node-3: connection refused
        > degrade: replication failed: node-3: connection refused
        recheck followers=2,3 committed=5:8192,1024:8192,1025:4096 next=1025:6144 local=5:8192,1024:8192,1025:6144
        > list recheck=1 to=2
        listed recheck=1 from=2 extents=5:8192:8192,1024:8192:8192,1025:6144:4096
        > list recheck=1 to=3
        unreachable recheck=1 from=3 why=connection refused
        > still-read-only: follower node-3 does not answer: connection refused

        # Node 3 is back. It never got the failed packet of 1025, and it lost the end of tiny
        # extent 5 (say its disk did): both lag, the partition is writable.
        recheck followers=2,3 committed=5:8192,1024:8192,1025:4096 next=1025:6144 local=5:8192,1024:8192,1025:6144
        > list recheck=2 to=2
        listed recheck=2 from=2 extents=5:8192:8192,1024:8192:8192,1025:6144:4096
        > list recheck=2 to=3
        listed recheck=2 from=3 extents=5:4096:0,1024:8192:0,1025:4096:0
        > lags 5: follower node-3 lacks bytes (repair pending)
        > lags 1025: follower node-3 lacks bytes (repair pending)
        > writable was: replication failed: node-3: connection refused
        state
        > aligned=3 degraded=-

        # Node 3 repaired tiny extent 5: it takes writes again; 1025 still lags. Meanwhile a
        # packet of 1024 is refused by node 2: 1024 lags even though node 2's listing, taken
        # before, showed it whole.
        recheck followers=2,3 committed=5:8192,1024:8192,1025:4096 next=1025:6144 local=5:8192,1024:8192,1025:6144
        > list recheck=3 to=2
        listed recheck=3 from=2 extents=5:8192:8192,1024:8192:8192,1025:6144:4096
        > list recheck=3 to=3
        extent-refused extent=1024 why=node-2: batch at 12288 starts past this replica's 8192 bytes
        > lags 1024: node-2: batch at 12288 starts past this replica's 8192 bytes
        listed recheck=3 from=3 extents=5:8192:0,1024:8192:0,1025:4096:0
        > caught-up 5
        lagging
        > lagging=1024,1025

        # Released extents count for nobody: once the log released 1024 it is not tracked, and it
        # no longer lags.
        recheck followers=2,3 committed=5:8192,1025:4096 next=1025:6144 local=5:8192,1025:6144
        > list recheck=4 to=2
        listed recheck=4 from=2 extents=5:8192:8192,1025:6144:4096
        > list recheck=4 to=3
        listed recheck=4 from=3 extents=5:8192:0,1025:4096:0
        > caught-up 1024
        lagging
        > lagging=1025

        # A new term's alignment decides afresh: node 3 holds every committed byte of 1025 and
        # the unacknowledged tail here is cut, so nothing lags.
        elected term=4 followers=2,3 local=5:8192,1025:6144 known=5:8192,1025:4096
        > list align=4 to=2
        listed align=4 from=2 extents=5:8192:8192,1025:6144:4096
        > list align=4 to=3
        listed align=4 from=3 extents=5:8192:0,1025:4096:0
        > settle term=4 extents=5,1025
        settle term=4 released=- busy=-
        > track 5 committed=8192 len=8192
        > track 1025 committed=4096 len=6144 cut
        > aligned term=4
        lagging
        > lagging=-
    ");
}

/// Raft §5.1 (a message of an older term is refused) applied to primary-backup packets: a leader
/// deposed by an election it has not heard of still forwards appends. A follower that knows the
/// newer term refuses them; the deposed leader fails the write without degrading the partition
/// (the new leader's partition is fine) and takes no more writes under its old term.
#[test]
fn deposed_leader_packets_of_an_older_term_are_refused_and_it_stops_writing() {
    run("
        check-term sent=3 known=4
        > refused: sent under term 3, but this replica knows term 4
        check-term sent=4 known=4
        > take
        # The follower has not heard of the election its sender won yet.
        check-term sent=5 known=4
        > take
        # A sender built before packets carried a term.
        check-term sent=0 known=4
        > take

        elected term=3 followers=- local=1024:4096 known=-
        > settle term=3 extents=1024
        settle term=3 released=- busy=-
        > track 1024 committed=4096 len=4096
        > aligned term=3
        superseded term=3
        > superseded=-
        deposed term=3 newer=4
        > superseded term=3 newer=4
        # Told again, or of an older term: nothing new.
        deposed term=3 newer=4
        deposed term=2 newer=3
        superseded term=3
        > superseded=4
        # Elected again under term 4 (or later), it writes under that term.
        superseded term=4
        > superseded=-
        state
        > aligned=3 degraded=-
    ");
}

/// "Replication is scenario-aware" with a leader change in the middle of an append: node 1
/// (term 2) wrote a packet past the committed offset 8192 here and on node 3, but node 2 failed
/// it, so it was never acknowledged. Node 3 is elected (term 3): it knows 8192 committed (the
/// leader's packets told it), takes the shortest copy (node 2's 8192) and cuts its own tail; node
/// 1, now a follower, cuts its tail when the new leader's first packet arrives at 8192. Late
/// answers for term 2 are ignored. A write in flight keeps its tail (it may yet be acknowledged).
#[test]
fn scenario_aware_replication_a_leader_change_mid_append_cuts_the_unacknowledged_tail() {
    run("
        # Node 1, the old leader, sees the packet fail on node 2.
        replication-failed why=replication failed: node-2: connection reset
        > degrade: replication failed: node-2: connection reset

        # The new leader, node 3 (this replica from here on).
        elected term=3 followers=1,2 local=1024:12288 known=1024:8192
        > list align=3 to=1
        # An answer for an older term's alignment changes nothing.
        listed align=2 from=1 extents=1024:12288:8192
        listed align=3 from=1 extents=1024:12288:8192
        > list align=3 to=2
        listed align=3 from=2 extents=1024:8192:8192
        > settle term=3 extents=1024
        settle term=3 released=- busy=-
        > track 1024 committed=8192 len=12288 cut
        > aligned term=3
        # A settle for a round no longer under way changes nothing.
        settle term=3 released=- busy=-

        # Node 1 takes the new leader's first packet at 8192: it cuts its unacknowledged tail.
        follower-take have=12288 committed=8192 offset=8192
        > cut-then-write
        # A packet that continues a copy is written where it starts; a tiny extent's may leave
        # a gap (its writes start on page boundaries).
        follower-take have=8192 committed=8192 offset=8192
        > write
        follower-take have=100 committed=100 offset=4096 tiny
        > write
        # The new leader's tiny writes go past its track, the committed offset and its own copy,
        # on page boundaries: a track made from a length listed before a replica's write ended
        # is behind that write.
        tiny-offset next=4096 committed=4096 held=4096 align=4096
        > offset=4096
        tiny-offset next=4096 committed=8192 held=4096 align=4096
        > offset=8192
        tiny-offset next=4096 committed=4096 held=135168 align=4096
        > offset=135168
        tiny-offset next=100 committed=0 held=50 align=4096
        > offset=4096

        # The same election with a write to 1024 still in flight here: no cut, and appends
        # continue after the tail.
        elected term=4 followers=1,2 local=1024:12288 known=1024:8192
        > list align=4 to=1
        listed align=4 from=1 extents=1024:8192:8192
        > list align=4 to=2
        listed align=4 from=2 extents=1024:8192:8192
        > settle term=4 extents=1024
        settle term=4 released=- busy=1024
        > track 1024 committed=8192 len=12288
        > aligned term=4

        # And when the shell cannot tell which extents are busy, none is cut. Tiny extents
        # (ids 1 to 16) are never cut: their tails are other files' bytes.
        elected term=5 followers=- local=1024:12288,7:9000 known=1024:8192,7:4096
        > settle term=5 extents=7,1024
        settle term=5 released=- busy=?
        > track 7 committed=9000 len=9000
        > track 1024 committed=12288 len=12288
        > aligned term=5
        elected term=6 followers=2 local=7:9000 known=7:4096
        > list align=6 to=2
        listed align=6 from=2 extents=7:4096:4096
        > settle term=6 extents=7
        settle term=6 released=- busy=-
        > track 7 committed=4096 len=9000
        > aligned term=6
    ");
}

/// "Failures": a follower that fails a packet, or a leader whose own disk refuses a write, makes
/// the partition read-only; the first reason is kept. A replica that does not answer at a leader
/// change degrades it too. It is writable again only after a re-check in which every follower
/// answered (and holds every committed byte here: nothing lags; extents with nothing committed
/// do not count).
#[test]
fn failures_a_replica_that_fails_degrades_the_partition_until_every_follower_answers() {
    run("
        elected term=7 followers=2,3 local=1024:4096 known=-
        > list align=7 to=2
        unreachable align=7 from=2 why=10.0.0.2:17310: connection refused
        > list align=7 to=3
        listed align=7 from=3 extents=1024:4096:4096
        > settle term=7 extents=1024
        settle term=7 released=- busy=-
        > track 1024 committed=4096 len=4096
        > degrade: replicas unreachable at leader change: 10.0.0.2:17310: connection refused
        > aligned term=7
        # Further failures keep the first reason.
        write-refused why=this replica's extent store cannot write: no space
        replication-failed why=replication failed: node-3: timeout
        state
        > aligned=7 degraded=replicas unreachable at leader change: 10.0.0.2:17310: connection refused

        # Node 2 still does not answer: the re-check stops there.
        recheck followers=2,3 committed=1024:4096,1025:0 local=1024:4096
        > list recheck=1 to=2
        unreachable recheck=1 from=2 why=timeout
        > still-read-only: follower node-2 does not answer: timeout
        # A late answer for that re-check changes nothing.
        listed recheck=1 from=3 extents=1024:4096:4096

        # Overlapping duty rounds: a newer re-check supersedes the older one.
        recheck followers=2,3 committed=1024:4096 local=1024:4096
        > list recheck=2 to=2
        recheck followers=2,3 committed=1024:4096 local=1024:4096
        > list recheck=3 to=2
        listed recheck=2 from=2 extents=1024:4096:4096
        listed recheck=3 from=2 extents=1024:4096:4096
        > list recheck=3 to=3
        listed recheck=3 from=3 extents=1024:4096:4096
        > writable was: replicas unreachable at leader change: 10.0.0.2:17310: connection refused

        # A leader whose own disk is full degrades its partition too.
        write-refused why=this replica's extent store cannot write: no space
        > degrade: this replica's extent store cannot write: no space
    ");
}

/// "Committed lengths" after a restart: nothing is known committed, so a new leader takes the
/// largest committed offset its followers knew. Here the leader lost the unsynced end of its
/// copy in the crash (4096 on disk, 8000 committed): it lacks committed bytes, degrades the
/// partition, and at the re-check hands leadership to a follower that holds them all (leaders do
/// not repair). Extents the applied log released get no track.
#[test]
fn committed_lengths_recovery_after_restart_a_leader_short_of_committed_bytes_hands_over() {
    run("
        # Tracks made from the lengths on disk: only a leader's count as committed.
        track-from-disk len=4096 leading=true
        > next=4096 committed=4096
        track-from-disk len=4096 leading=false
        > next=4096 committed=0

        elected term=9 followers=2,3 local=1024:4096,1030:500 known=-
        > list align=9 to=2
        listed align=9 from=2 extents=1024:7000:8000,1030:500:500,1031:64:64
        > list align=9 to=3
        listed align=9 from=3 extents=1024:8000:8000,1030:500:500,1031:64:64
        > settle term=9 extents=1024,1030,1031
        # 1031: created through Raft, not applied here yet, and then released by the log.
        settle term=9 released=1031 busy=-
        > track 1024 committed=8000 len=4096
        > track 1030 committed=500 len=500
        > lags 1024: a follower's copy is short at the leader change
        > degrade: the leader lacks committed bytes of extents [ExtentId(1024)]
        > aligned term=9

        recheck followers=2,3 committed=1024:8000,1030:500 local=1024:4096,1030:500
        > list recheck=1 to=2
        # A follower that does not answer is passed over when the leader looks for a holder.
        unreachable recheck=1 from=2 why=timeout
        > list recheck=1 to=3
        listed recheck=1 from=3 extents=1024:8000:8000,1030:500:500
        > transfer to=3 lacks-committed
        # Nobody holds every committed byte: it stays read-only.
        recheck followers=2 committed=1024:8000 local=1024:4096
        > list recheck=2 to=2
        listed recheck=2 from=2 extents=1024:7000:8000
        > still-read-only: this leader lacks committed bytes of extents [ExtentId(1024)] and no replica holds them all

        # A follower after a restart knows no committed offset: the new leader's first packet at
        # its committed offset cuts the old tail.
        follower-take have=9000 committed=0 offset=8000
        > cut-then-write
        # A reopened store's extents are all compared with the leader's first.
        repair have=4096 committed=8000 suspect=true block=4096
        > compare upto=4096
        > copy first=1 count=1
    ");
}

/// docs/data-store.md, "Reopening a failed store": a leader whose store failed hands leadership
/// to a follower — the same one for four rounds, then the next — and a follower (or a lone
/// replica) reopens; after the reopen nothing is aligned, as after a restart.
#[test]
fn reopening_a_failed_store_a_leader_hands_over_and_a_follower_reopens() {
    run("
        elected term=4 followers=- local=1024:10 known=-
        > settle term=4 extents=1024
        settle term=4 released=- busy=-
        > track 1024 committed=10 len=10
        > aligned term=4
        store-failed leading=true followers=2,3
        > transfer to=2 store-failed
        store-failed leading=true followers=2,3
        > transfer to=2 store-failed
        store-failed leading=true followers=2,3
        > transfer to=2 store-failed
        store-failed leading=true followers=2,3
        > transfer to=2 store-failed
        store-failed leading=true followers=2,3
        > transfer to=3 store-failed
        store-failed leading=false followers=1,3
        > reopen
        store-failed leading=true followers=-
        > reopen
        state
        > aligned=4 degraded=-
        store-reopened
        state
        > aligned=- degraded=-
    ");
}

/// "Replication is scenario-aware": the leader writes waiting packets of an extent in offset
/// order, as one batch of at most the batch size from where the last one ended; stale retries
/// below that point are refused, and a gap stops the batch.
#[test]
fn scenario_aware_replication_batches_continue_the_extent_in_offset_order() {
    run("
        plan-batch next=100 max=1000 waiting=50:10,100:10,110:20,140:5
        > stale=50 take=100,110
        plan-batch next=130 max=1000 waiting=140:5
        > stale=- take=-
        plan-batch next=0 max=256 waiting=0:128,128:128,256:128
        > stale=- take=0,128
        # A batch takes at least one packet, however large.
        plan-batch next=0 max=64 waiting=0:128
        > stale=- take=0
    ");
}

/// The driver fails a script whose answers differ from what it expects.
#[test]
#[should_panic(expected = "line 2")]
fn the_driver_fails_a_wrong_expectation() {
    run("\nstore-failed leading=false followers=-\n> transfer to=2 store-failed");
}

/// The driver fails a script that leaves an answer unexpected.
#[test]
#[should_panic(expected = "reopen")]
fn the_driver_fails_an_unexpected_answer() {
    run("store-failed leading=false followers=-");
}
