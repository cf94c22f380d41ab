"""A user's environments in a child process of their own, so that a call past its deadline ends.

A Python thread cannot be stopped: an environment call that overran `env_timeout` in a thread
kept running -- and holding whatever it held, a CPU, a lock, a connection -- after the rollout
had given up on it.  Here the environments of a rollout worker live in one child process
(`python -m rlhf_core.rollout.env_host AGENT AGENT_FILE`).  Every call is a request over its
pipes with a deadline; a call that misses it is ended by SIGKILLing the child, which takes the
call along, and is a `TimeoutError` naming the call.  The next batch of episodes starts a fresh
child.  The child exits when its parent is gone (it polls `getppid()`); what user code prints goes to
stderr (stdout carries the protocol: length-prefixed pickles of plain values only, so nothing
of the user's module has to be importable here).
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
import traceback

from rlhf_core.rollout.environment import Step, load_environment, takes_images

_HEADER = struct.Struct("!Q")


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from `fd`; None at EOF; TimeoutError once `deadline` (time.monotonic) passes."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _send(fd: int, obj) -> None:
    data = pickle.dumps(obj)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _recv(fd: int, deadline: float | None = None):
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(header)[0], deadline)
    if body is None:
        raise EOFError("the environment process closed its pipe mid-message")
    return pickle.loads(body)


class EnvironmentProcess:
    """`new(n)`, then `reset(i, prompt, label) -> str` and `step(i, action) -> Step` on the i-th of
    n environments, each call bounded by `timeout` seconds."""

    def __init__(self, agent: str, agent_file: str | None, timeout: float):
        self.agent, self.agent_file, self.timeout = agent, agent_file, timeout
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "rlhf_core.rollout.env_host", self.agent, self.agent_file or ""],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def _request(self, what: str, *msg):
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            _send(self.proc.stdin.fileno(), msg)
            reply = _recv(self.proc.stdout.fileno(), time.monotonic() + self.timeout)
        except TimeoutError:
            self.close()  # SIGKILL: the call does not run on
            raise TimeoutError(f"environment call {what} took longer than {self.timeout}s (env_timeout); "
                               f"its process was killed") from None
        except (BrokenPipeError, EOFError):
            reply = None
        if reply is None:
            code = self.proc.wait()
            self.proc = None
            raise RuntimeError(f"the environment process died during {what} (exit code {code})")
        if reply[0] == "error":
            raise RuntimeError(f"environment call {what} raised {reply[1]}\n{reply[2]}")
        return reply[1]

    def new(self, n: int) -> None:
        self._request("Environment()", "new", n)

    def reset(self, i: int, prompt: str, label: str, images: list | None = None) -> str:
        return self._request("reset", "reset", i, prompt, label, images)

    def step(self, i: int, action: str):
        reward, feedback, done, images = self._request("step", "step", i, action)
        return Step(reward=reward, feedback=feedback, done=done, images=images)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                pipe.close()
            self.proc = None

    def __del__(self):
        self.close()


def _serve(agent: str, agent_file: str | None) -> None:
    """The child: load the Environment class, then answer requests until stdin closes."""
    parent = os.getppid()

    def orphaned():  # a thread, so that it also ends a child whose main thread is stuck in user code
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    proto_in, proto_out = sys.stdin.fileno(), os.dup(1)
    os.dup2(2, 1)  # user prints must not corrupt the protocol
    sys.stdout = sys.stderr

    envs, env_cls, load_error = [], None, None
    try:
        env_cls = load_environment(agent, agent_file)
    except Exception as e:  # reported on the first request, where the caller waits for it
        load_error = e
    while (msg := _recv(proto_in)) is not None:
        op, *args = msg
        try:
            if load_error is not None:
                raise load_error
            if op == "new":
                envs, result = [env_cls() for _ in range(args[0])], None
            elif op == "reset":
                i, prompt, label, images = args
                env = envs[i]
                result = str(env.reset(prompt, label, images=images) if images and takes_images(env) else env.reset(prompt, label))
            else:  # plain values back: the user's Step may come from a module the parent cannot import
                i, action = args
                step = envs[i].step(action)
                images = getattr(step, "images", None)
                result = (None if step.reward is None else float(step.reward), step.feedback, bool(step.done),
                          None if images is None else [bytes(b) for b in images])
            reply = ("ok", result)
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}", traceback.format_exc(limit=8))
        _send(proto_out, reply)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2] or None)
