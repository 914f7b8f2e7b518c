"""The live page at / in a real headless browser (Debian's chromium through Selenium, no driver download):
the streamed answer equals the API's, and hovering a generated token highlights that step's top prompt
tokens by step_log_c, coloured as Explanation.to_html() colours them."""
from __future__ import annotations

import shutil

import httpx
import pytest
import torch

from macs_kernels.api.explanation import whole_answer_scores
from macs_kernels.api.prompts import qa_messages
from macs_kernels.api.viz import _unit
from tests.helpers import QUESTIONS

from .conftest import TINY, rows

webdriver = pytest.importorskip("selenium.webdriver", reason="the page test needs selenium (the test extra)")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="no system browser: apt-get install -y chromium chromium-driver (Debian/Ubuntu) to run the page test",
)]
MAX_TOKENS = 6
TOP_K = 5  # page.js marks this many top tokens


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def ask_on_page(browser, url: str, question: str, context: str, max_tokens: int, timeout: float = 120):
    """Loads the page, asks `question` about `context`, and waits for the stream to end."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url + "/")
    browser.find_element(By.ID, "question").send_keys(question)
    browser.find_element(By.ID, "context").send_keys(context)
    limit = browser.find_element(By.ID, "max_tokens")
    limit.clear()
    limit.send_keys(str(max_tokens))
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, timeout).until(
        lambda d: d.find_element(By.ID, "status").text not in ("idle", "streaming"))
    assert browser.find_element(By.ID, "status").text == "done"


def test_page_streams_the_answer_and_follows_the_pointer(server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    question, context = QUESTIONS[0]
    ask_on_page(browser, server.url, question, context, MAX_TOKENS)
    api = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": TINY, "messages": qa_messages(question, context), "max_tokens": MAX_TOKENS,
        "attribution": {"source": context},
    }).json()
    answer = browser.find_element(By.ID, "answer")
    assert answer.get_attribute("textContent") == api["choices"][0]["message"]["content"]

    attribution = api["choices"][0]["attribution"]
    start, end = attribution["source_span"]
    log_c = rows(attribution["step_log_c"])
    tokens = answer.find_elements(By.CSS_SELECTOR, "span[data-step]")
    assert len(tokens) == len(attribution["generated_ids"])
    cells = browser.find_elements(By.CSS_SELECTOR, "#prompt span")
    assert [c.get_attribute("textContent") for c in cells] == attribution["input_tokens"]
    hoverable = [t for t in tokens if t.size["width"] > 0]
    for token in (hoverable[1], hoverable[-1]):
        step = int(token.get_attribute("data-step"))
        ActionChains(browser).move_to_element(token).perform()
        assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-view") == str(step)
        marked = [i for i, c in enumerate(cells) if "top" in c.get_attribute("class").split()]
        row = log_c[step, start:end]
        expected = sorted(range(start, end), key=lambda i: (-row[i - start].item(), i))[:TOP_K]
        assert marked == sorted(expected)
        assert torch.isfinite(row).all()
        # Colours: heatmap.js applied to viz._unit of the step's log c over the source span.
        for i, weight in zip(range(start, end), _unit(row)):
            fade = round(255 * (1 - weight))
            assert cells[i].value_of_css_property("background-color") == f"rgba(255, {fade}, {fade}, 1)"
    # Click pins the step: moving away keeps it; "whole answer" releases it.
    ActionChains(browser).move_to_element(hoverable[0]).click().perform()
    ActionChains(browser).move_to_element(browser.find_element(By.ID, "prompt")).perform()
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-view") == hoverable[0].get_attribute(
        "data-step")
    assert browser.find_element(By.ID, "mean").find_element(By.XPATH, "..").text.startswith(
        f"Prompt: step {hoverable[0].get_attribute('data-step')} (")
    browser.find_element(By.ID, "mean").click()
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-view") == "mean"
    # The heading names the view once: the button back to the whole answer hides while it is shown.
    assert browser.find_element(By.ID, "mean").find_element(By.XPATH, "..").text == "Prompt: whole answer"
    whole = whole_answer_scores(log_c)[start:end]  # the default view: Explanation.scores
    marked = [i for i, c in enumerate(cells) if "top" in c.get_attribute("class").split()]
    assert marked == sorted(sorted(range(start, end), key=lambda i: (-whole[i - start].item(), i))[:TOP_K])
    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_page_is_self_contained(server):
    """Nothing is fetched from outside the server: every script and stylesheet is a local path."""
    page = httpx.get(server.url + "/").text
    assert "http://" not in page and "https://" not in page and "//cdn" not in page
    for asset in ("/static/page.js", "/static/page.css", "/static/heatmap.js"):
        assert asset in page and httpx.get(server.url + asset).status_code == 200
