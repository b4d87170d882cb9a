"""gRPC/protobuf contracts. Sources live in proto/src, generated stubs in proto/gen.

Importing this package also turns gRPC's fork support off for the process
(unless the environment already says otherwise). Every gRPC user here imports
these stubs before it makes a channel or server, which is when gRPC reads the
setting. Why: with fork support on, every fork() of a process that has used
gRPC runs gRPC's fork handlers, and a child started with ``preexec_fn`` (Ray
starts its GCS and raylet that way) runs them between fork and exec. There they
restart poller threads whose fds ``close_fds`` then closes, and the child can
abort ("epoll_wait error: Bad file descriptor"). Abseil's abort handler arms a
3 s alarm that survives exec, so the process that was started dies of SIGALRM
3 s later. We never use gRPC in a forked child that does not exec, which is the
only case fork support exists for. tests/proto/test_grpc_fork.py reproduces it.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
