"""The scheduling policy: pure code, snapshot in, decisions out. No I/O, no clock, no randomness
except a seeded ``random.Random`` passed in. Shared by the live controller and the simulator."""
