//! One tokio loop over terminal events, monitor snapshots, drill progress and a slow
//! tick. It redraws only when something changed, and at most every
//! [`FRAME_BUDGET`] (~20 fps), so a burst of data never drives the render rate.

use std::time::Duration;

use crossterm::event::{Event, EventStream, KeyEventKind, MouseButton, MouseEventKind};
use futures::StreamExt;
use ratatui::DefaultTerminal;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::action::{Action, Effect};
use super::app::App;
use super::keymap;
use super::render::render;
use super::{TuiError, TuiOptions};
use idemwatch_drills as drills;
use idemwatch_engine::consumers::ConsumerMode;
use idemwatch_monitor::Monitor;

pub const FRAME_BUDGET: Duration = Duration::from_millis(50);
const TICK: Duration = Duration::from_secs(1);

pub async fn run(terminal: &mut DefaultTerminal, opts: TuiOptions) -> Result<(), TuiError> {
    let mut monitor = Monitor::new(&opts.config).map_err(|e| TuiError::Setup(e.to_string()))?;
    if let Ok(size) = terminal.size() {
        monitor.set_chart_columns(crate::app::chart_columns(size.width));
    }
    let mut handle = monitor.spawn();
    let (tx, mut rx) = mpsc::unbounded_channel::<Action>();
    let theme = opts.theme;
    let mut app = App::new(chrono::Utc::now(), opts.demo.is_some(), opts.banner.clone());
    app.drills_allowed = opts.demo.is_some() || opts.config.drills.allow_live;
    if let Ok(size) = terminal.size() {
        app.update(Action::Resize {
            width: size.width,
            height: size.height,
        });
    }

    // The Inventory's "twice" check runs once, on a scratch database.
    let twice_tx = tx.clone();
    tokio::spawn(async move {
        let checks = drills::twice::check_all(ConsumerMode::Idempotent, 60).await;
        let _ = twice_tx.send(Action::TwiceChecked(
            checks.into_iter().filter_map(Result::ok).collect(),
        ));
    });

    let mut events = EventStream::new();
    let mut tick = tokio::time::interval(TICK);
    let mut dirty = true;
    let mut last_draw = Instant::now() - FRAME_BUDGET;
    loop {
        if dirty && last_draw.elapsed() >= FRAME_BUDGET {
            terminal
                .draw(|f| render(f, &app, &theme))
                .map_err(TuiError::Terminal)?;
            dirty = false;
            last_draw = Instant::now();
        }
        let next_frame = last_draw + FRAME_BUDGET;
        let action = tokio::select! {
            event = events.next() => match event {
                Some(Ok(e)) => translate(e, &app),
                Some(Err(e)) => return Err(TuiError::Terminal(e)),
                None => Some(Action::Quit),
            },
            changed = handle.snapshots.changed() => match changed {
                Ok(()) => handle.snapshots.borrow_and_update().clone().map(Action::Snapshot),
                Err(_) => None,
            },
            Some(action) = rx.recv() => Some(action),
            _ = tick.tick() => Some(Action::Tick(chrono::Utc::now())),
            _ = tokio::time::sleep_until(next_frame), if dirty => None,
        };
        if let Some(action) = action {
            for effect in app.update(action) {
                perform(effect, &app, &opts, &handle.commands, &tx);
            }
            dirty = true;
        }
        if app.should_quit {
            return Ok(());
        }
    }
}

/// Terminal event → action (keys through the keymap).
fn translate(event: Event, app: &App) -> Option<Action> {
    match event {
        Event::Key(k) if k.kind == KeyEventKind::Press => keymap::action_for(k, app),
        Event::Mouse(m) => match m.kind {
            MouseEventKind::Down(MouseButton::Left) => Some(Action::Click {
                column: m.column,
                row: m.row,
            }),
            MouseEventKind::ScrollUp => Some(Action::ScrollUp),
            MouseEventKind::ScrollDown => Some(Action::ScrollDown),
            _ => None,
        },
        Event::Resize(width, height) => Some(Action::Resize { width, height }),
        _ => None,
    }
}

/// Carry out one effect the app asked for. The slow ones (export, replay, drill)
/// run on their own tasks and come back as actions, so the loop never waits.
fn perform(
    effect: Effect,
    app: &App,
    opts: &TuiOptions,
    monitor: &mpsc::Sender<idemwatch_monitor::MonitorCommand>,
    tx: &mpsc::UnboundedSender<Action>,
) {
    match effect {
        Effect::Monitor(cmd) => {
            let _ = monitor.try_send(cmd);
        }
        Effect::Copy(text) => copy(&text),
        Effect::Export => export(app, opts, tx),
        Effect::Deploy => {
            if let Some(demo) = &opts.demo {
                demo.deploy();
            }
        }
        Effect::AddMarker { label } => add_marker(label, opts, tx),
        Effect::ReplayDeadLetter(id) => replay_dead_letter(id, opts, tx),
        Effect::StartDrill { scenario, mode } => start_drill(scenario, mode, opts, tx),
    }
}

/// OSC 52: the terminal (or tmux, or the SSH client's terminal) puts the text on
/// its clipboard; the dashboard never touches a local clipboard.
fn copy(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout();
    let _ = write!(out, "\x1b]52;c;{}\x07", base64(text.as_bytes()));
    let _ = out.flush();
}

/// `e`: the window on screen as an HTML report in the report directory (named by
/// the report, [`idemwatch_monitor::report::Report::export_into`]); the path on the status line.
fn export(app: &App, opts: &TuiOptions, tx: &mpsc::UnboundedSender<Action>) {
    let Some(snapshot) = app.snapshot.clone() else {
        let _ = tx.send(Action::Status(
            "nothing to export before the first poll".into(),
        ));
        return;
    };
    let dir = opts.report_dir.clone();
    let tx = tx.clone();
    tokio::task::spawn_blocking(move || {
        let report = idemwatch_monitor::report::Report::from_snapshot(&snapshot);
        let line = match report.export_into(idemwatch_monitor::report::Format::Html, &dir) {
            (path, Ok(())) => format!("report written to {}", path.display()),
            (path, Err(e)) => format!("report not written to {}: {e}", path.display()),
        };
        let _ = tx.send(Action::Status(line));
    });
}

/// `m` in the demo: the demo writes the marker where the monitor reads markers.
fn add_marker(label: String, opts: &TuiOptions, tx: &mpsc::UnboundedSender<Action>) {
    let Some(demo) = opts.demo.clone() else {
        return;
    };
    let tx = tx.clone();
    tokio::spawn(async move {
        if let Err(e) = demo.add_marker(&label).await {
            let _ = tx.send(Action::Status(format!("marker not saved: {e}")));
        }
    });
}

/// A dead letter back onto its consumer's queue; what became of it on the status line.
fn replay_dead_letter(id: i64, opts: &TuiOptions, tx: &mpsc::UnboundedSender<Action>) {
    let Some(target) = opts.drill_target.clone() else {
        let _ = tx.send(Action::Status(
            "no engine database and queue to replay into".into(),
        ));
        return;
    };
    let tx = tx.clone();
    tokio::spawn(async move {
        let replayed =
            idemwatch_engine::replay::replay_by_id(&target.db_url, &target.queue_url, id).await;
        let line = match replayed {
            Ok(r) => match r.letters.first() {
                Some(l) if r.replayed == 1 => format!(
                    "dead letter #{id} replayed to {} (replay {})",
                    l.queue.as_deref().unwrap_or("?"),
                    l.replay_count
                ),
                Some(l) => format!(
                    "dead letter #{id} ({}) not replayed: {}",
                    l.consumer,
                    l.status.skipped_because().unwrap_or("nothing published")
                ),
                None => format!("dead letter #{id} is gone"),
            },
            Err(e) => format!("dead letter #{id} not replayed: {e}"),
        };
        let _ = tx.send(Action::Status(line));
    });
}

/// A drill with the options its target builds ([`drills::DrillTarget::options`]),
/// its progress lines forwarded as actions, its report as the last one.
fn start_drill(
    scenario: drills::Scenario,
    mode: ConsumerMode,
    opts: &TuiOptions,
    tx: &mpsc::UnboundedSender<Action>,
) {
    let Some(target) = opts.drill_target.clone() else {
        let _ = tx.send(Action::DrillFinished(Err(
            "no database to drill against".into()
        )));
        return;
    };
    let (progress_tx, mut progress_rx) = mpsc::unbounded_channel::<String>();
    let forward = tx.clone();
    tokio::spawn(async move {
        while let Some(line) = progress_rx.recv().await {
            let _ = forward.send(Action::DrillProgress(line));
        }
    });
    let done = tx.clone();
    let options = target.options(scenario, mode);
    tokio::spawn(async move {
        let result = match options {
            Ok(mut o) => {
                o.progress = Some(progress_tx);
                drills::run(o)
                    .await
                    .map(Box::new)
                    .map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        };
        let _ = done.send(Action::DrillFinished(result));
    });
}

/// Standard base64 (RFC 4648, padded) for OSC 52; a dozen lines are lighter than a
/// dependency for the few bytes of a key.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_is_the_standard_padded_alphabet() {
        assert_eq!(super::base64(b"34-SIM-0007"), "MzQtU0lNLTAwMDc=");
        assert_eq!(super::base64(b"ab"), "YWI=");
        assert_eq!(super::base64(b"abc"), "YWJj");
        assert_eq!(super::base64(b""), "");
    }
}
