"""The warm-up: the steps a model or engine is warmed with (steps), the keep rule that measures
which pay (calibrate), the stored plan and one target's warm-up (plan), and calibration after READY
in idle time (after_ready)."""
