"""The control room: Ray actors (controller, ranks), the operation queue, step planning on
the host with numpy, and the checkpoint and profile stores. No torch at import time."""
