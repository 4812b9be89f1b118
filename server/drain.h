// attnd's shutdown: SIGINT and SIGTERM, and the drain they start.
//
// CatchShutdownSignals installs a handler that hands each signal through a pipe to
// WaitForShutdownSignal (a handler, not sigwait: threads a library starts before main never
// blocked the signals). Installed before anything starts, so a signal during the start is kept
// and drains the server as soon as it serves.
//
// Drain, run on its own thread once the first signal arrives: the server turns NOT_SERVING and
// not ready, refuses new calls (UNAVAILABLE) and gives those in flight --shutdown-grace seconds,
// after which gRPC cancels them (and the computations stop at their next row block). Then, with
// --drain-to, every cache moves to that peer (server/handover.h) and the server keeps answering
// for up to 2 s more (within the grace), so a client that comes back meets NOT_FOUND ending
// moved_to=PEER; with --cache-dir every cache left is written and fsynced before gRPC stops. A
// second signal exits at once (status 1). gRPC's own shutdown starts only once the calls in flight
// have answered, and a moment after: it sends GOAWAY and closes each connection as its last stream
// ends, and a connection closed with the client's frames unread is reset, which can lose an
// answer still on its way (an 8 MiB Tiled output through docker's port proxy did, once). When
// Drain returns, the gRPC server's Wait() returns too; the HTTP port is still up (for the
// caller to stop).
#pragma once

#include "absl/status/status.h"
#include "server/startup.h"

namespace attn {

// INTERNAL when the signal pipe cannot be made.
absl::Status CatchShutdownSignals();

// Blocks until a caught signal arrives; returns its number.
int WaitForShutdownSignal();

// The drain above, after `signal` (for the message), with config's --shutdown-grace for calls in
// flight, its --drain-to and its bearer token for the peer. Returns attnd's exit status: 0, or 3
// when --cache-dir could not take every cache (the log says why; what is on disk is a verified
// prefix of each, and clients re-send the rest).
int Drain(RunningServer& server, int signal, const AttndConfig& config);

}  // namespace attn
