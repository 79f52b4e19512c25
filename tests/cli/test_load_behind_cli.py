"""``generate --load-behind``: the checkpoint's pass behind the first step, end to end through the CLI and the job
runner (the report, the run's memory check, a merged LoRA): the latents of the load before the first step."""

import json

from h3_blackwell.cli import main as cli
from tests.fixtures.tiny_lora import tiny_checkpoint_and_lora


def test_generate_behind_the_first_step_gives_the_loads_latents(tmp_path):
    ck, lora = tiny_checkpoint_and_lora(tmp_path, seed=4)
    reports = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        assert cli.main(["generate", "--output", str(out), "--model", str(ck), "--steps", "2", "--device", "cpu",
                         "--lora", f"{lora}:0.8", "--load-behind", mode]) == 0
        reports[mode] = json.loads((out / "report.json").read_text())
    off, on = reports["off"], reports["on"]
    assert on["backends"]["load"]["choice"] == "behind the first step"
    assert off["backends"]["load"]["choice"] == "before the first step"
    assert on["latent_checksums"]["video_sha256"] == off["latent_checksums"]["video_sha256"]
    assert on["latent_checksums"]["audio_sha256"] == off["latent_checksums"]["audio_sha256"]
    assert on["backends"]["lora"]["report"]["merged_nvfp4"]  # the stack was merged, block by block
