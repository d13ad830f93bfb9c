"""A multi-host gpufleet on one machine: network-namespace hosts (netns.py) and a whole fleet
on them (fleet.py); scenarios in test_scenarios.py; by hand: scripts/multihost.sh."""
