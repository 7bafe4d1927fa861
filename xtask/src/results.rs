//! The result channel: what the guest's `/init` writes to its second serial port, and its parser.
//!
//! Grammar (one marker per line, every marker line starts with [`MARK`]):
//! ```text
//! @@AIOS-LAB init t=<uptime>                  /init started (guest uptime, seconds)
//! @@AIOS-LAB info <text>                      a note (module loaded, queue setup, …)
//! @@AIOS-LAB ready t=<uptime>                 modules loaded, devices waited for
//! @@AIOS-LAB step <id> begin <name> t=<uptime>
//! <the step's stdout and stderr, as written>
//! @@AIOS-LAB step <id> end rc=<rc> t=<uptime> (preceded by one extra "\n" so it starts a line)
//! @@AIOS-LAB done t=<uptime>
//! ```
//! A step without its end marker was interrupted (the guest died or timed out during it).

pub const MARK: &str = "@@AIOS-LAB";

#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub id: String,
    pub name: String,
    /// `None`: no end marker (still running, or interrupted).
    pub rc: Option<i32>,
    pub begin_t: Option<f64>,
    pub end_t: Option<f64>,
    pub output: String,
}

impl Step {
    /// Guest wall time of the step, from its markers.
    pub fn seconds(&self) -> Option<f64> {
        Some(self.end_t? - self.begin_t?)
    }
}

#[derive(Debug, Default, PartialEq)]
pub struct Log {
    pub init_t: Option<f64>,
    pub ready_t: Option<f64>,
    pub done_t: Option<f64>,
    pub done: bool,
    pub info: Vec<String>,
    pub steps: Vec<Step>,
    /// Text outside any step (should stay empty).
    pub stray: String,
}

/// `t=12.34` among the words → 12.34.
fn time_of(words: &[&str]) -> Option<f64> {
    words
        .iter()
        .rev()
        .find_map(|w| w.strip_prefix("t=")?.parse().ok())
}

/// Drops the "\n" the guest writes in front of each end marker.
fn close_output(step: &mut Step) {
    if step.output.ends_with('\n') {
        step.output.pop();
    }
}

/// Parses the whole log so far. It may still be growing: a last line without its newline is
/// taken as step output, never as a marker.
pub fn parse(text: &str) -> Log {
    let mut log = Log::default();
    // Index into log.steps of the step whose output is being read.
    let mut open: Option<usize> = None;
    for raw in text.split_inclusive('\n') {
        let complete = raw.ends_with('\n');
        let line = raw.trim_end_matches('\n').trim_end_matches('\r');
        let marker = if complete {
            line.strip_prefix(MARK).and_then(|r| r.strip_prefix(' '))
        } else {
            None
        };
        let words: Vec<&str> = marker.map(|m| m.split(' ').collect()).unwrap_or_default();
        let handled = match words.as_slice() {
            ["init", rest @ ..] => {
                log.init_t = time_of(rest);
                true
            }
            ["ready", rest @ ..] => {
                log.ready_t = time_of(rest);
                true
            }
            ["done", rest @ ..] => {
                log.done = true;
                log.done_t = time_of(rest);
                true
            }
            ["info", ..] => {
                log.info.push(
                    marker.unwrap_or_default()["info".len()..]
                        .trim()
                        .to_string(),
                );
                true
            }
            ["step", id, "begin", name, rest @ ..] => {
                if let Some(i) = open.take() {
                    // The previous step never ended; leave its rc at None.
                    close_output(&mut log.steps[i]);
                }
                log.steps.push(Step {
                    id: id.to_string(),
                    name: name.to_string(),
                    rc: None,
                    begin_t: time_of(rest),
                    end_t: None,
                    output: String::new(),
                });
                open = Some(log.steps.len() - 1);
                true
            }
            ["step", id, "end", rc, rest @ ..] => {
                match (open, rc.strip_prefix("rc=").and_then(|r| r.parse().ok())) {
                    (Some(i), Some(rc)) if log.steps[i].id == *id => {
                        let step = &mut log.steps[i];
                        step.rc = Some(rc);
                        step.end_t = time_of(rest);
                        close_output(step);
                        open = None;
                        true
                    }
                    _ => false,
                }
            }
            _ => false,
        };
        if !handled && !complete && open.is_none() {
            // A line still arriving outside any step: most likely a marker cut mid-write; wait
            // for its newline before deciding what it is.
            continue;
        }
        if !handled {
            let mut piece = line.to_string();
            if complete {
                piece.push('\n');
            }
            match open {
                Some(i) => log.steps[i].output.push_str(&piece),
                None => log.stray.push_str(&piece),
            }
        }
    }
    log
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_run() {
        let text = "@@AIOS-LAB init t=1.50\n\
                    @@AIOS-LAB info module nvme loaded poll_queues=1\n\
                    @@AIOS-LAB ready t=2.00\n\
                    @@AIOS-LAB step 1 begin devs t=2.10\n\
                    brw-rw---- 1 root root 259, 0 /dev/nvme0n1\n\
                    \n\
                    @@AIOS-LAB step 1 end rc=0 t=2.35\n\
                    @@AIOS-LAB step 2 begin fail t=2.40\n\
                    no newline at the end\n\
                    @@AIOS-LAB step 2 end rc=1 t=2.50\n\
                    @@AIOS-LAB done t=2.60\n";
        let log = parse(text);
        assert!(log.done);
        assert_eq!(log.init_t, Some(1.5));
        assert_eq!(log.ready_t, Some(2.0));
        assert_eq!(log.done_t, Some(2.6));
        assert_eq!(log.info, ["module nvme loaded poll_queues=1"]);
        assert_eq!(log.steps.len(), 2);
        assert_eq!(log.steps[0].name, "devs");
        assert_eq!(log.steps[0].rc, Some(0));
        assert_eq!(
            log.steps[0].output,
            "brw-rw---- 1 root root 259, 0 /dev/nvme0n1\n"
        );
        assert!((log.steps[0].seconds().unwrap() - 0.25).abs() < 1e-9);
        assert_eq!(log.steps[1].rc, Some(1));
        assert_eq!(log.steps[1].output, "no newline at the end");
        assert!(log.stray.is_empty());
    }

    #[test]
    fn serial_line_endings_are_tolerated() {
        let text = "@@AIOS-LAB step 1 begin x t=1\r\nhello\r\n\r\n@@AIOS-LAB step 1 end rc=0 t=2\r\n@@AIOS-LAB done t=3\r\n";
        let log = parse(text);
        assert_eq!(log.steps[0].output, "hello\n");
        assert_eq!(log.steps[0].rc, Some(0));
        assert!(log.done);
    }

    #[test]
    fn missing_end_marker_means_interrupted() {
        let text = "@@AIOS-LAB step 1 begin hang t=5\nstarted\nstill work";
        let log = parse(text);
        assert!(!log.done);
        assert_eq!(log.steps.len(), 1);
        assert_eq!(log.steps[0].rc, None);
        assert_eq!(log.steps[0].seconds(), None);
        assert_eq!(log.steps[0].output, "started\nstill work");
    }

    #[test]
    fn a_begin_closes_an_unfinished_step() {
        let text = "@@AIOS-LAB step 1 begin a t=1\nout\n@@AIOS-LAB step 2 begin b t=2\n\n@@AIOS-LAB step 2 end rc=0 t=3\n";
        let log = parse(text);
        assert_eq!(log.steps[0].rc, None);
        assert_eq!(log.steps[0].output, "out");
        assert_eq!(log.steps[1].rc, Some(0));
        assert_eq!(log.steps[1].output, "");
    }

    #[test]
    fn partial_marker_line_is_not_a_marker_yet() {
        let log = parse("@@AIOS-LAB step 1 begin a t=1\nx\n\n@@AIOS-LAB step 1 end rc=");
        assert_eq!(log.steps[0].rc, None);
        let log = parse("@@AIOS-LAB step 1 begin a t=1\nx\n\n@@AIOS-LAB step 1 end rc=0 t=2\n");
        assert_eq!(log.steps[0].rc, Some(0));
        assert_eq!(log.steps[0].output, "x\n");
        // Outside a step, half a marker is not stray text either.
        let log = parse("@@AIOS-LAB init t=1\n@@AIOS-LAB info module crc64 i");
        assert_eq!(log.stray, "");
        assert!(log.info.is_empty());
    }

    #[test]
    fn lookalikes_and_mismatched_ends_stay_output() {
        let text = "early text\n@@AIOS-LAB step 1 begin a t=1\n@@AIOS-LABEL not a marker\n@@AIOS-LAB step 9 end rc=0 t=2\n";
        let log = parse(text);
        assert_eq!(log.stray, "early text\n");
        assert_eq!(log.steps[0].rc, None);
        assert_eq!(
            log.steps[0].output,
            "@@AIOS-LABEL not a marker\n@@AIOS-LAB step 9 end rc=0 t=2\n"
        );
    }

    #[test]
    fn negative_and_large_exit_codes() {
        let log = parse("@@AIOS-LAB step s1 begin x\n\n@@AIOS-LAB step s1 end rc=137\n");
        assert_eq!(log.steps[0].rc, Some(137));
        assert_eq!(log.steps[0].begin_t, None);
    }
}
