"""Attribution baselines the evaluation compares MACS with: AtMan and AttnLRP."""
