"""Regenerates benchmarks/results/serve_page.png: `macs-kernels serve` with the default model, the live page in
chromium, one QA question answered, the pointer on the answer's key token.

    python python/serve_screenshot.py    # needs the serve and test extras and a system chromium
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Who designed the Eiffel Tower?"
CONTEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
           "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889 as "
           "the centrepiece of the World's Fair. Locally nicknamed 'La dame de fer', it has become a global "
           "cultural icon of France and one of the most recognisable structures in the world.")


def main() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "macs_kernels.apps.serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,960"):
        options.add_argument(flag)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        browser.get(url + "/")
        browser.find_element(By.ID, "question").send_keys(QUESTION)
        browser.find_element(By.ID, "context").send_keys(CONTEXT)
        limit = browser.find_element(By.ID, "max_tokens")
        limit.clear()
        limit.send_keys("16")
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 900).until(lambda d: d.find_element(By.ID, "status").text == "done")
        tokens = browser.find_elements(By.CSS_SELECTOR, "#answer span[data-step]")
        key = next((t for t in tokens if "Gust" in t.text), tokens[len(tokens) // 2])
        ActionChains(browser).move_to_element(key).click().perform()
        out = ROOT / "benchmarks" / "results" / "serve_page.png"
        browser.save_screenshot(str(out))
        browser.quit()
        print(f"wrote {out}")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
