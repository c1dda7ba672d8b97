"""FlashRAG's prompt templates and answer extraction (FlashRAG 0.1.2, https://github.com/RUC-NLPIR/FlashRAG, MIT
licensed: see THIRD_PARTY_LICENSES), reproduced so that a run under `pipeline.prompt_style=flashrag` sends the
prompts FlashRAG sends and reads its answers as FlashRAG does, and its scores compare with FlashRAG's question by
question on the same inputs. The strings are copied verbatim, FlashRAG's quirks included (its default instruction has
no space after "document."). The IRCoT instruction and demonstration are those of FlashRAG's `IRCOTPipeline`; the
demonstration comes from the IRCoT paper (Trivedi et al., 2023).

Which method uses what (`Method` renders; each method's module says how its loop reads the style):

- standard RAG, Iter-RetGen, no retrieval, FLARE: `default_messages`, FlashRAG's default `PromptTemplate` (a system
  message with the instruction and the passages, a user message with the question), through the chat template when
  the run has one, else joined by a blank line as FlashRAG's plain form is. The answer is the generation as is.
- IRCoT: `ircot_prompt`, always plain text (FlashRAG builds it with `enable_chat=False`); the answer is
  `ircot_answer` of the joined thoughts.
- Self-Ask and Search-R1 keep their own prompts: FlashRAG's Self-Ask exemplars are not reproduced here, and
  Search-R1 is a trained protocol.

Differences this style does not remove: FlashRAG cuts a prompt longer than `generator_max_input_len` to its first
and last halves, here a prompt is never cut; FlashRAG reads a passage's title as the first line of its `contents`
as written (with the quotes of its Wikipedia dumps), the corpus loader here strips quotes and spaces from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from orthrus_rag.data.types import Passage

PROMPT_STYLES = ("native", "flashrag")

# FlashRAG's default PromptTemplate (prompt/base_prompt.py)
DEFAULT_SYSTEM = ("Answer the question based on the given document."
                  "Only give me the answer and do not output any other words."
                  "\nThe following are given documents.\n\n{reference}")
DEFAULT_USER = "Question: {question}"

# FlashRAG's IRCOTPipeline (pipeline/active_pipeline.py), split over lines but character for character (the tests
# hold a checksum of FlashRAG's strings)
IRCOT_INSTRUCTION = (
    "You serve as an intelligent assistant, adept at facilitating users through complex, multi-hop "
    "reasoning across multiple documents. This task is illustrated through demonstrations, each consisting "
    "of a document set paired with a relevant question and its multi-hop reasoning thoughts. Your task is "
    "to generate one thought for current step, DON'T generate the whole thoughts at once! If you reach "
    'what you believe to be the final step, start with "So the answer is:".')
IRCOT_EXAMPLE = (
    "Wikipedia Title: Kurram Garhi\nKurram Garhi is a small village located near the city of Bannu, which "
    "is the part of Khyber Pakhtunkhwa province of Pakistan. Its population is approximately 35000. Barren "
    "hills are near this village. This village is on the border of Kurram Agency. Other nearby villages "
    "are Peppal, Surwangi and Amandi Kala.\n\n"
    "Wikipedia Title: 2001–02 UEFA Champions League second group stage\nEight winners and eight runners- "
    "up from the first group stage were drawn into four groups of four teams, each containing two group "
    "winners and two runners- up. Teams from the same country or from the same first round group could not "
    "be drawn together. The top two teams in each group advanced to the quarter- finals.\n\n"
    "Wikipedia Title: Satellite tournament\nA satellite tournament is either a minor tournament or event "
    "on a competitive sporting tour or one of a group of such tournaments that form a series played in the "
    "same country or region.\n\n"
    "Wikipedia Title: Trojkrsti\nTrojkrsti is a village in Municipality of Prilep, Republic of "
    "Macedonia.\n\n"
    "Wikipedia Title: Telephone numbers in Ascension Island\nCountry Code:+ 247< br> International Call "
    "Prefix: 00 Ascension Island does not share the same country code( +290) with the rest of St "
    "Helena.\n\n"
    "Question: Are both Kurram Garhi and Trojkrsti located in the same country?\nThought: Kurram Garhi is "
    "located in the country of Pakistan. Trojkrsti is located in the country of Republic of Macedonia. "
    "Thus, they are not in the same country. So the answer is: no.\n\n")
IRCOT_USER = "{reference}Question: {question}\nThought:"
IRCOT_ANSWER = "So the answer is:"  # FlashRAG's ircot_pred_parse and IRCOTPipeline's stopping rule


def check_prompt_style(prompt_style: str, answer_format: str = "free") -> None:
    """The style is known, and FlashRAG's, which reads the answer from free text, goes with `answer_format=free`."""
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt_style {prompt_style!r}; expected one of {', '.join(PROMPT_STYLES)}")
    if prompt_style == "flashrag" and answer_format != "free":
        raise ValueError(f"prompt_style=flashrag reads the answer as FlashRAG does, from the free generation; "
                         f"answer_format must be free, got {answer_format!r}")


def reference(passages: Sequence[Passage]) -> str:
    """FlashRAG's `format_reference` with no reference template: one "Doc i(Title: ...) text" line a passage."""
    return "".join(f"Doc {i + 1}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages))


def default_messages(question: str, passages: Sequence[Passage] | None) -> list[dict[str, str]]:
    """FlashRAG's default template as chat messages; `passages=None` (no retrieval) leaves the reference empty, as
    FlashRAG's `naive_run` does."""
    system = DEFAULT_SYSTEM.format(reference=reference(passages or []), question=question)
    return [{"role": "system", "content": system},
            {"role": "user", "content": DEFAULT_USER.format(reference="", question=question)}]


def ircot_prompt(question: str, passages: Sequence[Passage], thoughts: Sequence[str]) -> str:
    """FlashRAG's IRCoT prompt: the instruction and demonstration, a blank line, the passages and the question, then
    the thoughts so far joined by a space, appended with nothing between (FlashRAG's `get_string` with
    `previous_gen`)."""
    refs = "".join(f"Wikipedia Title: {p.title}\n{p.text}\n\n" for p in passages)
    prompt = f"{IRCOT_INSTRUCTION}\n\n{IRCOT_EXAMPLE}" + "\n\n" + IRCOT_USER.format(reference=refs, question=question)
    return prompt + previous_gen(thoughts)


def previous_gen(thoughts: Sequence[str]) -> str:
    """The chain so far as FlashRAG appends it to a prompt: joined by a space; nothing when that is "" or " "."""
    joined = " ".join(thoughts)
    return "" if joined in ("", " ") else joined


def ircot_answer(text: str) -> str:
    """FlashRAG's `ircot_pred_parse`: the text between the first "So the answer is:" and the next one (if any),
    stripped; without the phrase, the whole text as is."""
    return text.split(IRCOT_ANSWER)[1].strip() if IRCOT_ANSWER in text else text
