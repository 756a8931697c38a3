"""The ``topic_retrieval`` task (CacheGen's LongChat task): a multi-topic conversation built
from template sentences, then "what is the first topic we discussed?". Separate from the
other synthetic tasks because of its topic and sentence tables.
"""

from __future__ import annotations

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.prompts.base import Prompt, finish_prompt, fit_pieces, seeded_rng, wrap_chat

TOPICS = (
    "jazz music", "mountain climbing", "electric cars", "ancient Egypt", "coffee brewing", "chess openings",
    "volcanoes", "beekeeping", "the Roman Empire", "solar panels", "origami", "deep sea fish", "football",
    "bread baking", "black holes", "knitting", "the Great Wall of China", "tropical rainforests",
    "photography", "the Olympic Games", "gardening", "submarines", "Japanese cuisine", "dinosaurs",
    "hot air balloons", "classical ballet", "wind turbines", "honey bees", "the Moon landing", "sailing",
    "vintage cars", "tea ceremonies", "the Amazon river", "skateboarding", "pottery", "polar bears",
    "video games", "the Eiffel Tower", "wine tasting", "yoga", "lighthouses", "birdwatching",
    "the Sahara desert", "comic books", "fireworks", "the piano", "coral reefs", "trains",
)


TOPIC_SENTENCES = (
    "{T} is a subject that many people find fascinating.",
    "There is a long history behind {t}, and it has changed a lot over the years.",
    "One of the most interesting things about {t} is how much there is to learn.",
    "People who enjoy {t} often spend years studying the details.",
    "If you are new to {t}, it helps to start with the basics.",
    "Experts in {t} often disagree about the best approach.",
    "Books, films and museums have all helped to make {t} more widely known.",
    "Some of the questions about {t} are still open today.",
    "A good way to understand {t} is to look at a few concrete examples.",
    "Many communities around the world have their own traditions connected with {t}.",
    "The vocabulary of {t} can be confusing at first, but it becomes familiar with practice.",
    "Patience matters a great deal when it comes to {t}.",
    "Teachers who explain {t} well usually start with a simple story.",
    "The future of {t} depends on the people who keep it alive.",
    "Whenever I think about {t}, I remember how much effort goes into it.",
    "It is easy to underestimate how much work {t} requires.",
    "Newcomers to {t} are often surprised by how welcoming the community is.",
    "There are many myths about {t}, and not all of them are true.",
    "The best resources on {t} are written by people with real experience.",
    "Over time, technology has changed the way people approach {t}.",
)


def topic_retrieval_prompt(tokenizer, context_tokens: int, seed: int = 0, index: int = 0,
                           turn_tokens: int | None = None) -> Prompt:
    """CacheGen's LongChat topic retrieval: a conversation over several topics, then "What is
    the first topic we discussed?". Each topic is a user turn naming it and an assistant
    reply of about ``turn_tokens`` tokens of sentences about it (shuffled templates; default
    ``context_tokens // 5``, so 4-5 topics at any size). Scored by substring match."""
    rng = seeded_rng("topic_retrieval", seed, index)
    turn_tokens = turn_tokens or max(40, context_tokens // 5)
    topics = rng.sample(TOPICS, len(TOPICS))
    pieces, is_header = [], []
    for topic in topics:
        pieces.append(f"USER: I would like to discuss the topic of {topic}.\nASSISTANT: Sure, let us talk "
                      f"about {topic}.")
        is_header.append(True)
        size = 0
        while size < turn_tokens:  # a reply about the topic: shuffled template sentences
            for template in rng.sample(TOPIC_SENTENCES, len(TOPIC_SENTENCES)):
                sent = template.format(t=topic, T=topic[0].upper() + topic[1:])
                pieces.append(sent)
                is_header.append(False)
                size += len(sent) // 4
                if size >= turn_tokens:
                    break
    head = "Below is a record of our previous conversation on many different topics.\n\n"

    def body(chosen):
        if chosen and is_header[chosen[-1]]:
            chosen = chosen[:-1]  # no topic without a reply
        return head + "".join(("\n\n" if is_header[i] and i else " " if i else "") + pieces[i] for i in chosen)

    chosen, part, ids = fit_pieces(tokenizer, lambda c: wrap_chat(tokenizer, body(c), "")[::2], pieces,
                                   context_tokens, "topic_retrieval", skip=True)
    num_topics = sum(is_header[i] for i in chosen) - int(bool(chosen) and is_header[chosen[-1]])
    if num_topics < 1 or len(chosen) < 2:
        raise ExtractionError(f"context_tokens={context_tokens} holds no conversation turn for topic_retrieval")
    question = ("\n\nWhat is the first topic we discussed? Only give me the topic name. "
                "Do not summarize yourself.")
    return finish_prompt("topic_retrieval", tokenizer, context_tokens, seed, index, body(chosen), part, ids,
                         question, topics[0], 40, meta={"num_topics": num_topics, "turn_tokens": turn_tokens})
