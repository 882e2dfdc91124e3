"""Load shapes for loadtest/locustfile.py, picked with `--load-shape` (add this file after the
locustfile: `locust -f loadtest/locustfile.py,loadtest/shapes.py --load-shape spike ...`).

`-u` is the peak user count and `--shape-seconds` the length of the run:
- steady: all users for the whole run;
- ramp:   10% of the users, rising linearly to 100% over 80% of the run, then held;
- spike:  20% of the users, 100% from 30% to 50% of the run, back to 20%;
- mixed:  interactive and multimodal chat the whole run, long-context users join for the middle
          half (the lanes under a mixed load).
"""

from __future__ import annotations

from locust import LoadTestShape, events

from locustfile import InteractiveChat, LongContextUser, MultimodalChat

CHAT = [InteractiveChat, MultimodalChat]


@events.init_command_line_parser.add_listener
def add_options(parser):
    # Not --profile: Locust has its own option of that name.
    parser.add_argument("--load-shape", choices=["steady", "ramp", "spike", "mixed"],
                        default="steady", help="load shape (loadtest/shapes.py)")
    parser.add_argument("--shape-seconds", type=float, default=60.0,
                        help="length of the shaped run in seconds")


def stages(profile: str, t: float, peak: int) -> tuple[int, list | None]:
    """(users, user classes) at fraction `t` of the run for a profile."""
    if profile == "ramp":
        return max(1, round(peak * min(1.0, 0.1 + 0.9 * t / 0.8))), None
    if profile == "spike":
        return (peak if 0.3 <= t < 0.5 else max(1, round(0.2 * peak))), None
    if profile == "mixed":
        if 0.25 <= t < 0.75:
            return peak, [*CHAT, LongContextUser]
        return max(1, round(0.7 * peak)), CHAT
    return peak, None


class ProfileShape(LoadTestShape):
    use_common_options = True

    def tick(self):
        options = self.runner.environment.parsed_options
        t = self.get_run_time() / options.shape_seconds
        if t >= 1.0:
            return None
        users, classes = stages(options.load_shape, t, options.num_users or 1)
        # Spawn fast enough to reach each stage within a second or two.
        return users, max(1.0, users / 2), classes
