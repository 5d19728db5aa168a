"""The accumulation core every front end holds: windows, their exact weights, the noise scale and the step record.

Pure: no Trainer. ``engine`` drives a window (plan, count, weigh, close), ``normalization`` holds the exactness
arithmetic, ``noise_scale`` the gradient noise scale, and ``step_report`` the record of one optimizer step that an
owner publishes and the monitor reads.
"""
