// An example remote agent for Agent-Reach's `http` protocol, with Node's standard library only.
//
// The broker POSTs {task_id, capability, payload, attempt, deadline_at, session, metadata} to
// /run, signed the Standard Webhooks way. This agent serves one capability, `text.upper`, and
// answers with JSON ({"result": ...} or {"error": ...}) or, when the broker accepts
// text/event-stream, with SSE events `output`, `progress` and a last `result` or `error`.
//
// A task of a session gets the session as its turn read it ({session_id, revision, state}); the
// agent counts the turns in it and writes the next revision with its result (a `session` event
// before the `result` event, or "session" beside "result" in JSON).
//
// Payload hooks let the broker's own tests drive failures: `fail_status`/`fail_times` (answer
// that HTTP status for the first calls of a task), `error` (fail the task), `delay_ms`.
//
//   PORT=9000 REACH_AGENT_SECRET=whsec_... node examples/agents/node/agent.js
'use strict';

const crypto = require('node:crypto');
const http = require('node:http');

const HOST = process.env.HOST || '127.0.0.1';
const PORT = Number(process.env.PORT || 9000);
const SECRET = process.env.REACH_AGENT_SECRET || '';
// A payload of up to 1 MiB and a session's state of up to 256 KiB (the broker's defaults)
const MAX_BODY_BYTES = 4 * 1024 * 1024;
const TIMESTAMP_TOLERANCE_S = 300; // as the Standard Webhooks libraries: against replays
const DEFAULT_DELAY_MS = 20;
const MAX_REMEMBERED = 1000; // task ids kept for hooks and /stats, so memory stays bounded
const MAX_TIMER_MS = 2 ** 31 - 1; // setTimeout fires at once for anything longer

// The HMAC key is the base64 after the prefix (Standard Webhooks secrets are whsec_<base64>).
const signingKey = SECRET ? Buffer.from(SECRET.replace(/^whsec_/, ''), 'base64') : null;

const state = {
  healthy: process.env.HEALTH_FAIL !== '1',
  calls: 0,
  cancelled: [], // task ids whose caller closed the connection before the reply ended
  deadlineExceeded: [], // task ids this agent stopped because their deadline passed
  failuresByTask: new Map(), // task id -> injected failures answered so far
  lastHeaders: {},
};

class HttpError extends Error {
  constructor(status, code, message, retryable = false) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryable = retryable;
  }
}

function errorBody(code, message, retryable) {
  return { error: { code, message, retryable } };
}

function sendJson(res, status, body) {
  const text = JSON.stringify(body);
  res.writeHead(status, {
    'Content-Type': 'application/json',
    'Content-Length': Buffer.byteLength(text),
  });
  res.end(text);
}

function remember(list, taskId) {
  list.push(taskId);
  if (list.length > MAX_REMEMBERED) list.shift();
}

function readBody(req, limit) {
  return new Promise((resolve, reject) => {
    if (Number(req.headers['content-length']) > limit) {
      reject(new HttpError(413, 'too_large', `the body is over ${limit} bytes`));
      return;
    }
    const chunks = [];
    let size = 0;
    req.on('data', (chunk) => {
      size += chunk.length;
      if (size > limit) {
        req.removeAllListeners('data');
        req.pause(); // read no more of it: the 413 closes the connection
        reject(new HttpError(413, 'too_large', `the body is over ${limit} bytes`));
        return;
      }
      chunks.push(chunk);
    });
    req.on('end', () => resolve(Buffer.concat(chunks)));
    req.on('error', reject);
  });
}

// Returns why the request is not signed by the broker, or null when it is.
function signatureProblem(headers, body) {
  const id = headers['webhook-id'];
  const timestamp = headers['webhook-timestamp'];
  const signatures = headers['webhook-signature'];
  if (!id || !timestamp || !signatures) return 'missing webhook-id, -timestamp or -signature';
  if (!/^\d+$/.test(timestamp)) return 'webhook-timestamp is not unix seconds';
  if (Math.abs(Date.now() / 1000 - Number(timestamp)) > TIMESTAMP_TOLERANCE_S) {
    return 'webhook-timestamp is too far from now';
  }
  const expected = crypto
    .createHmac('sha256', signingKey)
    .update(`${id}.${timestamp}.`)
    .update(body)
    .digest();
  // The header may carry several signatures (the broker rotating its secret): any may match.
  for (const entry of signatures.split(' ')) {
    const [version, encoded] = entry.split(',', 2);
    if (version !== 'v1' || !encoded) continue;
    const given = Buffer.from(encoded, 'base64');
    // timingSafeEqual throws on unequal lengths; the length of an HMAC is no secret.
    if (given.length === expected.length && crypto.timingSafeEqual(given, expected)) return null;
  }
  return 'no signature matches';
}

function parseCall(body) {
  let call;
  try {
    call = JSON.parse(body.toString('utf8'));
  } catch {
    throw new HttpError(400, 'bad_json', 'the body is not JSON');
  }
  if (!call || typeof call !== 'object' || typeof call.task_id !== 'string') {
    throw new HttpError(400, 'bad_request', 'the body must be an object with a task_id');
  }
  if (call.capability !== 'text.upper') {
    throw new HttpError(400, 'unknown_capability', `no capability ${call.capability}`);
  }
  const payload = call.payload;
  if (!payload || typeof payload !== 'object' || typeof payload.text !== 'string') {
    throw new HttpError(400, 'bad_input', 'payload.text must be a string');
  }
  const deadlineAt = call.deadline_at == null ? null : Date.parse(call.deadline_at);
  if (Number.isNaN(deadlineAt)) {
    throw new HttpError(400, 'bad_request', 'deadline_at is not an ISO-8601 timestamp');
  }
  const session = call.session && typeof call.session === 'object' ? call.session : null;
  return { taskId: call.task_id, payload, deadlineAt, session };
}

// The first `fail_times` calls of a task answer `fail_status`; the broker retries 408, 429, 5xx.
function injectedFailure(taskId, payload) {
  const status = payload.fail_status;
  if (status === undefined) return null;
  if (!Number.isInteger(status) || status < 400 || status > 599) {
    throw new HttpError(400, 'bad_input', 'payload.fail_status must be an HTTP error status');
  }
  const times = Number.isInteger(payload.fail_times) ? payload.fail_times : 1;
  const failed = state.failuresByTask.get(taskId) || 0;
  if (failed >= times) return null;
  state.failuresByTask.set(taskId, failed + 1);
  if (state.failuresByTask.size > MAX_REMEMBERED) {
    state.failuresByTask.delete(state.failuresByTask.keys().next().value); // the oldest task
  }
  return status;
}

// How a call's outcome is written: as SSE events, or as one JSON body in which the
// intermediate events have no place.
function sseReply(res) {
  res.writeHead(200, { 'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache' });
  res.flushHeaders(); // the broker sees the call accepted before the first event
  // JSON.stringify escapes newlines, so each event's data is one line.
  const frame = (event, data) => `event: ${event}\ndata: ${JSON.stringify(data)}\n\n`;
  return {
    event: (name, data) => res.write(frame(name, data)),
    result: (data, session) => res.end((session ? frame('session', session) : '') + frame('result', data)),
    error: (data) => res.end(frame('error', data)),
  };
}

function jsonReply(res) {
  return {
    event: () => {},
    result: (data, session) => sendJson(res, 200, session ? { result: data, session } : { result: data }),
    error: (data) => sendJson(res, 200, { error: data }),
  };
}

// One call in flight: its timers, and the single place where it ends (with a result, an error,
// its deadline, or the caller hanging up), so no timer outlives it.
function startCall(res, taskId, deadlineAt, reply) {
  const timers = new Set();
  let ended = false;
  const stop = () => {
    ended = true;
    for (const timer of timers) clearTimeout(timer);
    timers.clear();
  };
  const call = {
    later(ms, fn) {
      if (ended) return;
      const timer = setTimeout(() => {
        timers.delete(timer);
        fn();
      }, ms);
      timers.add(timer);
    },
    event(name, data) {
      if (!ended) reply.event(name, data);
    },
    finish(kind, data, session) {
      if (ended) return;
      stop();
      reply[kind](data, session);
    },
  };
  // 'close' comes when the reply is done or the connection is gone: before writableEnded it
  // is the broker cancelling the call.
  res.on('close', () => {
    if (res.writableEnded) return;
    stop();
    remember(state.cancelled, taskId);
  });
  if (deadlineAt !== null) {
    const left = deadlineAt - Date.now();
    const deadlineExceeded = () => {
      remember(state.deadlineExceeded, taskId);
      call.finish('error', {
        code: 'deadline_exceeded',
        message: `the deadline passed at ${new Date(deadlineAt).toISOString()}`,
        retryable: false,
      });
    };
    if (left <= 0) deadlineExceeded();
    else if (left < MAX_TIMER_MS) call.later(left, deadlineExceeded);
  }
  return call;
}

// The session's next state: this turn counted, its text the last one seen.
function nextSession(session, text) {
  if (session === null) return null;
  const state = session.state && typeof session.state === 'object' ? session.state : {};
  const turns = Number.isInteger(state.turns) ? state.turns : 0;
  return { state: { ...state, turns: turns + 1, last: text } };
}

// text.upper: one word per `delay_ms`, each sent as an output with the progress so far.
function upperWords(call, payload, session) {
  const text = payload.text;
  const delayMs = Number.isFinite(payload.delay_ms) ? payload.delay_ms : DEFAULT_DELAY_MS;
  const words = text.split(/\s+/).filter(Boolean);
  const n = words.length;
  const step = (i) => {
    if (i > n) {
      call.finish('result', { text: text.toUpperCase() }, nextSession(session, text));
      return;
    }
    call.later(delayMs, () => {
      const word = words[i - 1].toUpperCase();
      call.event('output', { text: i < n ? `${word} ` : word });
      call.event('progress', { percent: Math.round((100 * i) / n), message: `word ${i} of ${n}` });
      step(i + 1);
    });
  };
  step(1);
}

async function run(req, res) {
  state.calls += 1;
  state.lastHeaders = {
    traceparent: req.headers.traceparent,
    'idempotency-key': req.headers['idempotency-key'],
    'webhook-id': req.headers['webhook-id'],
  };
  const body = await readBody(req, MAX_BODY_BYTES);
  if (signingKey) {
    const problem = signatureProblem(req.headers, body);
    if (problem) throw new HttpError(401, 'bad_signature', problem);
  }
  const { taskId, payload, deadlineAt, session } = parseCall(body);
  const failStatus = injectedFailure(taskId, payload);
  if (failStatus !== null) {
    throw new HttpError(failStatus, 'injected', `asked to answer ${failStatus}`, true);
  }
  const streaming = (req.headers.accept || '').includes('text/event-stream');
  const reply = streaming ? sseReply(res) : jsonReply(res);
  const call = startCall(res, taskId, deadlineAt, reply);
  if (payload.error !== undefined) {
    call.finish('error', { code: String(payload.error), message: 'asked to fail', retryable: false });
    return;
  }
  upperWords(call, payload, session);
}

async function setHealth(req, res) {
  // A test hook, unauthenticated: the agent listens on loopback unless HOST says otherwise.
  let ok;
  try {
    ok = JSON.parse((await readBody(req, 1024)).toString('utf8')).ok;
  } catch {
    throw new HttpError(400, 'bad_json', 'the body is not JSON');
  }
  if (typeof ok !== 'boolean') throw new HttpError(400, 'bad_request', 'send {"ok": true|false}');
  state.healthy = ok;
  sendJson(res, 200, { status: ok ? 'ok' : 'failing' });
}

const routes = {
  'POST /run': run,
  'GET /healthz': (req, res) =>
    state.healthy
      ? sendJson(res, 200, { status: 'ok' })
      : sendJson(res, 503, { status: 'failing' }),
  'POST /admin/health': setHealth,
  'GET /stats': (req, res) =>
    sendJson(res, 200, {
      calls: state.calls,
      cancelled: state.cancelled,
      deadline_exceeded: state.deadlineExceeded,
      last_headers: state.lastHeaders,
    }),
};

async function handle(req, res) {
  try {
    const path = req.url.split('?')[0];
    const route = routes[`${req.method} ${path}`];
    if (!route) throw new HttpError(404, 'not_found', `no route ${req.method} ${path}`);
    await route(req, res);
  } catch (err) {
    if (!(err instanceof HttpError)) console.error(err);
    if (res.headersSent) {
      res.destroy(); // mid-reply: the broker sees a broken call, not a wrong answer
      return;
    }
    const { status, code, retryable } =
      err instanceof HttpError ? err : { status: 500, code: 'internal', retryable: true };
    // The rest of a body over the limit is not drained: the connection closes instead.
    if (status === 413) res.setHeader('Connection', 'close');
    sendJson(res, status, errorBody(code, err.message, retryable));
  }
}

const server = http.createServer((req, res) => {
  handle(req, res).catch((err) => {
    console.error(err);
    res.destroy();
  });
});

server.listen(PORT, HOST, () => {
  console.log(`listening on http://${HOST}:${server.address().port}`);
});

function shutDown() {
  server.close(() => process.exit(0));
  server.closeAllConnections(); // calls in flight end as if the broker had hung up
}
process.on('SIGTERM', shutDown);
process.on('SIGINT', shutDown);
