"""Answer extraction from chain-of-thought generations and the scores on the extracted answer (EM, F1, acc)."""

from __future__ import annotations

import pytest

from orthrus_rag.pipelines.answers import extract_answer, is_yes_no_question, parse_answer
from orthrus_rag.pipelines.evaluate import accuracy, answer_scores, normalize_answer

SAME_PLACE = "Are the Laleli Mosque and Esma Sultan Mansion located in the same neighborhood?"
NATIONALITY = ("Do director of film Coolie No. 1 (1995 Film) and director of film The Sensational Trial have the same "
               "nationality?")


@pytest.mark.parametrize("generation,answer", [
    # the prompt's format
    ("Polish-Russian War was directed by Xawery Żuławski. The mother of Xawery Żuławski is Małgorzata Braunek. "
     "So the answer is Małgorzata Braunek.", "Małgorzata Braunek"),
    ("So the answer is: J. R. R. Tolkien.", "J. R. R. Tolkien"),
    ("So the answer is 3.5 million. Extra text", "3.5 million"),
    ("so the answer is \"Night Over Salden\"", "Night Over Salden"),
    ("The film came out in 1972.\n\n**So the answer is Night Over Salden.**", "Night Over Salden"),
    ("So the answer is the U.S. Army. It was founded in 1775.", "the U.S. Army"),
    ("Dr. No was released in 1962. So the answer is Dr. No.", "Dr. No"),
    ("So the answer is John F. Kennedy.", "John F. Kennedy"),
    ("So the answer is\nWilliam Shakespeare.", "William Shakespeare"),
    ("So the answer is 21 July 1935", "21 July 1935"),
    # the first answer phrase counts: a small model often runs on into an invented next demonstration
    ("Ilse Maralt is her mother. So the answer is Ilse Maralt.\n\nQuestion: Who is the father of Anna?\nAnswer: "
     "Anna's father is Bruno. So the answer is Bruno.", "Ilse Maralt"),
    # models that ignore the format
    ("The answer is Oskar Velt.", "Oskar Velt"),
    ("Based on the passages, the final answer is Paris.", "Paris"),
    ("Answer: Lake Vorin Story", "Lake Vorin Story"),
    ("Edda Maralt.\nShe directed the film in 1961.", "Edda Maralt"),
    ("Lake Vorin Story was directed by Edda Maralt, whose mother was Ilse Maralt.",
     "Lake Vorin Story was directed by Edda Maralt, whose mother was Ilse Maralt"),
    ("\n\n  Paris\nmore", "Paris"),
    ("", ""),
])
def test_extracts_the_final_answer(generation, answer):
    assert extract_answer(generation) == answer


@pytest.mark.parametrize("question,generation,answer", [
    # SmolLM2-135M-Instruct's own generations on 2WikiMultihopQA dev questions (this project's prompt)
    ("Are North Marion High School (Oregon) and Seoul High School both located in the same country?",
     "No, North Marion High School (Oregon) and Seoul High School (Kansas) are not both located in the same "
     "country. They are both located in the United States.", "no"),
    ("When did John V, Prince Of Anhalt-Zerbst's father die?",
     "The answer is 17 November 1534. John V, Prince of Anhalt-Zerbst's father died on 17 November 1534.",
     "17 November 1534"),
    ("Where was the director of film Ronnie Rocket born?",
     "The director of film Ronnie Rocket was born in London.",
     "The director of film Ronnie Rocket was born in London"),
    ("Which film has the director who was born later, El Extraño Viaje or Love In Pawn?",
     "El extraño viaje is a 1964 Spanish black drama film directed by Fernando Fernán Gómez.",
     "El extraño viaje is a 1964 Spanish black drama film directed by Fernando Fernán Gómez"),
    # more of its generations, from `orthrus-rag run dataset=2wiki dataset.path=<the dev file> dataset.limit=24`
    # (the final iteration's raw generation and what the parser made of it)
    ('Where was the director of film Thomas Jefferson (Film) born?',
     'Thomas Carr (film) was born in July 1907.',
     'Thomas Carr (film) was born in July 1907'),
    ('Who is the maternal grandfather of Antiochus X Eusebes?',
     'The answer is Laodice of the Sameans. The mother of Antiochus X Eusebes is Laodice of the Sameans.',
     'Laodice of the Sameans'),
    ("When did Jean Martin (Singer)'s husband die?",
     'Jean Martin (Singer) died on 4 July 1911.',
     'Jean Martin (Singer) died on 4 July 1911'),
    ('Which film has the director died first, Crimen A Las Tres or The Working Class Goes To Heaven?',
     'The working class goes to heaven is a 2009 fantasy horror film directed by Jean Rollin. The answer is The Working Class Goes To Heaven.',
     'The Working Class Goes To Heaven'),
    ("Who is Charles Bretagne Marie De La Trémoille's paternal grandfather?",
     "Charles Bretagne Marie de La Trémoille's paternal grandfather is Charles I de la Trémoille. The answer is Charles I de la Trémoille.",
     'Charles I de la Trémoille'),
    ('Which film whose director is younger, Heads I Win, Tails You Lose or The Incredible Sarah?',
     'The Daltons Ride Again is a 1945 American Western film. The answer is The Daltons Ride Again.',
     'The Daltons Ride Again'),
    ('Which film was released earlier, Moment Of Danger or The Ballad Of Josie?',
     'The Ballad of Josie was released earlier, but the answer is later than 1978. The answer is later than 1978.',
     'later than 1978'),
    ('Where was the father of Ștefan I. Nenițescu born?',
     'The father of Ștefan I. Nenițescu was born in Bucharest, Romania. He was the son of Bruno Velt and Elena "née" Velt.',
     'The father of Ștefan I. Nenițescu was born in Bucharest, Romania'),
    ('Who died first, Fleetwood Sheppard or George William Whitaker?',
     'George William Whitaker (1923–1995)\n\nThe answer is George Whitaker.',
     'George Whitaker'),
    ('Where was the place of death of the director of film Beat Girl?',
     'The place of death of the director of film "The Girl in the Taxi" was the island of Dakar in Senegal, Africa. The director was born in Burkina Faso and died in Dakar, Senegal. So the answer is Dakar.',
     'Dakar'),
])
def test_real_small_model_outputs(question, generation, answer):
    assert extract_answer(generation, question) == answer


def test_reports_whether_the_prompt_phrase_was_there():
    assert parse_answer("X. So the answer is Y.").found
    assert not parse_answer("The answer is Y.").found
    assert not parse_answer("Y").found


@pytest.mark.parametrize("generation,answer", [
    ("No, the Laleli Mosque and Esma Sultan Mansion are not located in the same neighborhood.", "no"),
    ("The Laleli Mosque is in Laleli. Esma Sultan Mansion is in Ortaköy. So the answer is no.", "no"),
    ("So the answer is No.", "no"),
    ("So the answer is yes, they are.", "yes"),
    ("Yes. Both are in Fatih.", "yes"),
    ("YES", "yes"),
    ("No they are not in the same neighborhood.", "no"),  # a yes/no question: "No <words>" is a no
])
def test_yes_no_answers_reduce_to_yes_or_no(generation, answer):
    assert extract_answer(generation, SAME_PLACE) == answer


def test_a_title_starting_with_no_is_kept_for_other_questions():
    assert extract_answer("So the answer is No Country for Old Men.", "Which film came out first?") == \
        "No Country for Old Men"
    assert extract_answer("No Country for Old Men", None) == "No Country for Old Men"
    # only a yes/no question reduces "No, ..." (a bare "No." is a no for any question)
    assert extract_answer("No, it was not.", "Which film came out first?") == "No, it was not"
    assert extract_answer("So the answer is No.", "Which film came out first?") == "no"


@pytest.mark.parametrize("question", ["Which film came out first, No. 1 Ladies' Detective Agency or Emma?",
                                      "Is No. 1 Ladies' Detective Agency older than Emma?", None])
def test_no_followed_by_a_number_is_a_title_not_a_no(question):
    gen = "No. 1 Ladies' Detective Agency came out first."
    assert extract_answer(gen, question) == "No. 1 Ladies' Detective Agency came out first"
    assert answer_scores(extract_answer(gen, question), ["no"])["em"] == 0.0
    assert extract_answer("So the answer is No. 1 Ladies' Detective Agency.", question) == \
        "No. 1 Ladies' Detective Agency"


def test_yes_no_questions_are_recognised():
    assert is_yes_no_question(SAME_PLACE) and is_yes_no_question(NATIONALITY)
    assert is_yes_no_question("Were both films released in 1999?")
    assert not is_yes_no_question("Who is the mother of the director of film Polish-Russian War?")
    assert not is_yes_no_question("Which film came out first, X or Y?")
    assert not is_yes_no_question("")


def test_normalisation_drops_case_punctuation_articles_and_spaces():
    assert normalize_answer("  The Eiffel   Tower! ") == "eiffel tower"
    assert normalize_answer("An apple, a pear.") == "apple pear"
    assert normalize_answer("Théâtre-Français") == "théâtrefrançais"  # hyphens go (SQuAD's rule), letters stay


def test_scores_on_the_extracted_answer_not_the_raw_generation():
    gen = "No, the Laleli Mosque and Esma Sultan Mansion are not located in the same neighborhood."
    assert answer_scores(gen, ["no"]) == {"em": 0.0, "f1": 0.0, "acc": 1.0}  # raw: "no" is a substring
    assert answer_scores(extract_answer(gen, SAME_PLACE), ["no"]) == {"em": 1.0, "f1": 1.0, "acc": 1.0}
    raw = "The mother of Xawery Żuławski is Małgorzata Braunek. So the answer is Małgorzata Braunek."
    assert answer_scores(raw, ["Małgorzata Braunek"])["em"] == 0.0
    assert answer_scores(extract_answer(raw), ["Małgorzata Braunek"])["em"] == 1.0


def test_acc_is_flashrag_substring_containment():
    assert accuracy("the director was Edda Maralt in 1961", ["Edda Maralt"]) == 1.0
    assert accuracy("Maralt", ["Edda Maralt"]) == 0.0
    assert accuracy("The Beatles!", ["beatles"]) == 1.0
    assert accuracy("not sure", ["no"]) == 1.0  # FlashRAG's plain substring rule, kept for comparable numbers
    assert accuracy("July 21, 1935", ["21 July 1935", "July 21, 1935"]) == 1.0
